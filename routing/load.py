"""Load the router itself has caused: requests in flight, prefill not yet done, step timing."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress

from routing.steps import DECODE_AGREES, StepTimer
from routing.types import ReplicaView

RemoteLoad = tuple[int, float, float]
"""Other gateways' load on a replica: (requests in flight, pending prefill tokens, of which
presumably not yet computed)."""

NO_LOAD: RemoteLoad = (0, 0.0, 0.0)
"""No other gateway's load on a replica."""

HEAD_CREDIT_MAX = 0.9
"""At most this share of the oldest pending request's prefill is presumed done before its
first token arrives."""


class LoadTracker:
    """Counts, per replica, requests in flight and their estimated uncached prefill tokens.

    The gateway knows the moment it dispatches a request and the moment the first token comes
    back, so it can tell how much prefill work it has queued on each replica long before the
    engine's own metrics (scraped every few seconds) show it. Its `steps` time each replica's
    engine steps from the chunks it streams (routing/steps.py).
    """

    __slots__ = ("_drain", "_order", "inflight", "pending_prefill", "remote", "steps")

    def __init__(self, prefill_tokens_per_s: float | None = None,
                 speed_decode_agrees: float = DECODE_AGREES) -> None:
        self.inflight: dict[str, int] = {}
        self.pending_prefill: dict[str, float] = {}
        self.steps = StepTimer(prefill_tokens_per_s, speed_decode_agrees)
        self._drain: dict[str, float] = {}
        """Replica -> tokens of its oldest pending prefill that its engine has presumably
        computed: see `prefill_left`."""
        self._order: dict[str, deque[float]] = {}
        """Replica -> uncached tokens of its requests awaiting a first token, oldest first."""
        self.remote: dict[str, RemoteLoad] = {}
        """Replica -> (in flight, pending prefill tokens, of which left to compute) that other
        gateways sharing this one's routing state report having put there; added to this
        gateway's own counts in `view`, never to `inflight` or `pending_prefill` (what this
        gateway must finish)."""

    def own_load(self) -> dict[str, list[float]]:
        """What this gateway has in flight, as it tells others: {replica: [requests, pending
        prefill tokens, of those presumably not yet computed (`prefill_left`)]} for the
        replicas with requests. Others must see the same drained figure this gateway routes
        on: counted whole, its long prompts would make a replica look busier to every other
        gateway than to it, and they would spill away from it more than one gateway would."""
        pending = self.pending_prefill
        out: dict[str, list[float]] = {}
        for r, n in self.inflight.items():
            if n > 0:
                p = pending.get(r, 0.0)
                # What is presumed computed, in steps of 16 tokens: it grows every engine step,
                # and each change of the figure is a write to the other gateways.
                done = (p - self.prefill_left(r)) // 16.0 * 16.0 if p > 0.0 else 0.0
                out[r] = [n, round(p, 1), round(p - done, 1)]
        return out

    def set_remote(self, loads: Mapping[str, RemoteLoad]) -> None:
        """Replace the other gateways' load with `loads` (replicas absent: none)."""
        self.remote = {r: (max(0, int(n)), max(0.0, float(p)), max(0.0, float(left)))
                       for r, (n, p, left) in loads.items() if n > 0 or p > 0}

    def dispatched(self, replica: str, uncached_tokens: float) -> None:
        self._order.setdefault(replica, deque()).append(uncached_tokens)
        self.inflight[replica] = self.inflight.get(replica, 0) + 1
        self.pending_prefill[replica] = self.pending_prefill.get(replica, 0.0) + uncached_tokens

    def chunk(self, replica: str, now: float) -> None:
        """The replica streamed a chunk at `now`: one of its engine steps just ended."""
        batch = self.batch(replica)
        awaiting = self.pending_prefill.get(replica, 0.0) > 0.0
        if awaiting:
            self._credit(replica, now, batch)
        self.steps.chunk(replica, now, batch, awaiting)

    def batch(self, replica: str) -> int:
        """Requests in flight on the replica, this gateway's and the others' (as they last
        said): the engine's batch, which sets how long its decode steps take."""
        own = self.inflight.get(replica, 0)
        others = self.remote.get(replica) if self.remote else None
        return own + others[0] if others is not None else own

    def first_token(self, replica: str, uncached_tokens: float, now: float | None = None,
                    dispatched_at: float | None = None) -> None:
        """The replica finished this request's prefill: its prefill is no longer pending."""
        left = self.pending_prefill.get(replica, 0.0) - uncached_tokens
        self.pending_prefill[replica] = left if left > 1e-6 else 0.0
        order = self._order.get(replica)
        if order:
            if order[0] == uncached_tokens:
                order.popleft()
                self._drain[replica] = 0.0  # the next oldest one is now being prefilled
            else:
                with suppress(ValueError):  # not sent through dispatched(): nothing to drop
                    order.remove(uncached_tokens)
        if now is not None and dispatched_at is not None:
            # Another gateway with prefill pending there may have had first tokens in the
            # same step, which this one cannot see (nor those it sent in the last few
            # milliseconds, which its shared load does not show yet): the step's length is
            # not this request's prefill alone. Learned from, such steps skewed three
            # gateways' rates (tenants near saturation: 11,451 tokens/s against one gateway's
            # 6,651, and 20x its mean TTFT); none learned is far better (step waits not
            # priced, pending prefill counted whole). With their requests only decoding
            # there, the replica's own rate still learns (`StepTimer.prefill_done`): without
            # it, gateways sharing a fleet of mixed speeds learned almost no speeds.
            others = self.remote.get(replica)
            self.steps.prefill_done(replica, uncached_tokens, now, dispatched_at,
                                    shared=others is not None and (others[0] > 0
                                                                   or others[1] > 0.0),
                                    others_prefilling=others is not None and others[1] > 0.0,
                                    alone=self.pending_prefill.get(replica, 0.0) <= 0.0)

    def finished(self, replica: str, uncached_tokens: float, saw_first_token: bool) -> None:
        left = self.inflight[replica] = max(0, self.inflight.get(replica, 0) - 1)
        if not left:
            self.steps.idle(replica)
        if not saw_first_token:
            self.first_token(replica, uncached_tokens)

    def forget(self, replica: str) -> None:
        """The replica left: its counters and step timing go."""
        self.inflight.pop(replica, None)
        self.pending_prefill.pop(replica, None)
        self._drain.pop(replica, None)
        self._order.pop(replica, None)
        self.steps.forget(replica)

    def prefill_left(self, replica: str) -> float:
        """Pending prefill tokens less what the engine has presumably computed of them.

        Pending prefill only falls when a request's first token arrives, but a long prompt is
        prefilled in chunks over many steps: counted whole until its end, it makes a replica
        that is nearly through it look as busy as one that has not begun. Each step the
        gateway times there while prefill is pending computed about (its length less a
        decode-only step's) times the learned prefill rate, which errs low. The credit goes
        to the oldest request awaiting its first token only (an engine prefills in arrival
        order), and never all of it: if the router believed it cached more than the engine
        still held, its prefill is longer than believed, and that must not be taken off the
        requests queued behind it.
        """
        pending = self.pending_prefill.get(replica, 0.0)
        done = self._drain.get(replica, 0.0)
        return pending - done if done < pending else 0.0

    def _credit(self, replica: str, now: float, batch: int) -> None:
        """A step of `replica` (running `batch` sequences) ended at `now` with prefill
        pending: credit what it computed."""
        steps = self.steps
        last = steps.last_end(replica)
        # The replica's own learned rate when it has one (replicas may differ in speed).
        rate = steps.replica_rate(replica) or steps.rate
        if last is None or rate <= 0.0:
            return
        decode = steps.decode_s(batch) or 0.0
        extra = now - last - decode
        order = self._order.get(replica)
        if extra > 0.0 and order:
            head = HEAD_CREDIT_MAX * order[0]
            self._drain[replica] = min(head, self._drain.get(replica, 0.0) + rate * extra)

    def view(self, replica: str, now: float | None = None, engine_waiting: int = 0,
             kv_usage: float | None = None) -> ReplicaView:
        """What a policy sees of `replica` at `now`: this router's load there and the other
        gateways', its step and speeds, and what the engine's last scraped metrics said
        (`engine_waiting`, `kv_usage`; as the defaults, never scraped)."""
        steps = self.steps
        rate = steps.rate  # a property that adds what other gateways learned: read it once
        inflight = self.inflight.get(replica, 0)
        wait = rate * steps.remaining(replica, now) if now is not None and inflight else 0.0
        pending = self.pending_prefill.get(replica, 0.0)
        left = self.prefill_left(replica) if rate > 0.0 else None
        if self.remote:
            n, p, remote_left = self.remote.get(replica, NO_LOAD)
            inflight += n
            pending += p
            if left is not None:
                left += remote_left
        return ReplicaView(
            name=replica,
            inflight=inflight,
            pending_prefill_tokens=pending,
            step_wait_tokens=wait,
            prefill_left_tokens=left,
            speed=steps.speed(replica),
            busy_speed=steps.busy_speed(replica),
            engine_waiting=engine_waiting,
            kv_usage=kv_usage,
        )


def sum_loads(loads: Iterable[Mapping[str, Sequence[float]]]) -> dict[str, RemoteLoad]:
    """Other gateways' (or workers') `own_load`s summed per replica, for `set_remote`. An
    entry without the drained figure (an older gateway's) counts its pending prefill whole."""
    total: dict[str, RemoteLoad] = {}
    for replicas in loads:
        for replica, entry in replicas.items():
            n, pending = entry[0], float(entry[1])
            left = float(entry[2]) if len(entry) > 2 else pending
            n0, p0, l0 = total.get(replica, NO_LOAD)
            total[replica] = (n0 + int(n), p0 + pending, l0 + left)
    return total
