"""Request traces: Mooncake-format loading, synthetic workloads, prompt text, ideal hit ratio.

A trace request is a list of 512-token block ids (Mooncake `hash_ids`, chained: the same id
always follows the same predecessor). Prompt text is synthesised deterministically from the ids,
so equal id chains give equal text prefixes and each full block has the same amount of text
(`BLOCK_TOKENS * CHARS_PER_TOKEN` characters). Both the HTTP replay and the offline simulator
read traces through this module, so they see the same requests.
"""

from __future__ import annotations

import csv
import inspect
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import xxhash

# The public traces in the repository (data/traces/README.md: sources and licences).
TRACES_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"
MOONCAKE = TRACES_DIR / "synthetic_trace.jsonl"
RAGPULSE = TRACES_DIR / "ragpulse"
AZURE_CODE = TRACES_DIR / "azure" / "AzureLLMInferenceTrace_code.csv"
AZURE_CONV = TRACES_DIR / "azure" / "AzureLLMInferenceTrace_conv.csv"

BLOCK_TOKENS = 512
CHARS_PER_TOKEN = 4
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basil "
    "cedar dune ember fjord grove harbor iris jade kelp lumen maple nectar onyx pearl quartz "
    "reef sage thorn umber vale willow yarrow zephyr"
).split()


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace (times in seconds from the trace start)."""

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    session: str = ""

    def block_tokens(self, i: int) -> int:
        """Tokens in block i: full blocks, and the remainder in the last one."""
        if i < len(self.hash_ids) - 1:
            return BLOCK_TOKENS
        return max(1, self.input_tokens - BLOCK_TOKENS * (len(self.hash_ids) - 1))


def streams(i: int, share: float) -> bool:
    """Whether the i-th request (in sending order) streams when `share` of them do, spread
    evenly over the arrivals; the others are sent non-streaming."""
    return share >= 1.0 or int((i + 1) * share) > int(i * share)


def write_mooncake(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> str:
    """Write Mooncake-format rows as JSONL; returns a one-line account of what was written."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    span = rows[-1]["timestamp"] / 1000 if rows else 0.0
    return f"wrote {len(rows)} requests over {span:.0f} s to {path}"


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace (timestamp in ms), sorted by time.

    `hash_ids` should cover `input_length` in 512-token blocks. When a row has fewer ids, the
    rest of its prompt gets ids of its own (text no other request shares), so the prompt still
    has `input_length` tokens; extra ids past the length are dropped.
    """
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
                ids = row["hash_ids"]
                if isinstance(ids, dict):
                    raise ValueError("hash_ids is an object; this is not a Mooncake-format "
                                     "trace (RAGPulse traces load with load_ragpulse)")
                timestamp = float(row["timestamp"]) / 1000.0
                input_tokens = max(1, int(row["input_length"]))
                output_tokens = max(1, int(row["output_length"]))
                blocks = [int(h) for h in ids]
            except (KeyError, TypeError, ValueError) as exc:
                what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ValueError(f"{path}:{lineno}: {what}") from None
            n_blocks = -(-input_tokens // BLOCK_TOKENS)
            head = blocks[-1] if blocks else 0
            blocks += [_chain(head, f"{path}:{lineno}:{i}") for i in range(n_blocks - len(blocks))]
            out.append(TraceRequest(timestamp, input_tokens, output_tokens,
                                    tuple(blocks[:n_blocks]), str(row.get("session_id", ""))))
    out.sort(key=lambda r: r.timestamp_s)
    return out[:limit] if limit else out


def load_ragpulse(directory: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read RAGPulse's trace as 512-token-block requests.

    Its chunk ids are content ids, not prefix-chained, so they are chained here (a block's id
    depends on every chunk before it) to model what an exact prefix cache can reuse. Chunk
    lengths vary (at most 512 tokens); they are rounded to whole blocks of text by keeping
    the total token count and one block per chunk.
    """
    d = Path(directory)
    rows = []
    with open(d / "0_trace.jsonl") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    rows.sort(key=lambda r: float(r["timestamp"]))
    out = []
    for row in rows[:limit] if limit else rows:
        ids = row["hash_ids"]
        chunks = [f"{k}:{c}" for k in ("sys_prompt", "passages_ids", "history", "web_search",
                                       "user_input") for c in ids.get(k, [])]
        chained = _chained(chunks)
        h = chained[-1] if chained else 0
        n_blocks = max(1, -(-int(row["input_length"]) // BLOCK_TOKENS))
        # Keep the chain's head (the shared system prompt) and as many blocks as the length.
        blocks = chained + [_chain(h, f"pad{i}") for i in range(n_blocks)]
        out.append(TraceRequest(float(row["timestamp"]), int(row["input_length"]),
                                int(row["output_length"]), tuple(blocks[:n_blocks]),
                                str(row.get("session_id", ""))))
    return out


def _chain(parent: int, chunk: str) -> int:
    # Stable across processes, unlike hash(): replay and simulator must agree on ids.
    return xxhash.xxh3_64_intdigest(chunk.encode(), seed=parent) >> 2


def _chained(chunks: Iterable[str]) -> list[int]:
    """One id per chunk, each chained on the one before it (`_chain`, from 0)."""
    out, h = [], 0
    for c in chunks:
        h = _chain(h, c)
        out.append(h)
    return out


def load_azure(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read an Azure LLM inference trace (CSV: TIMESTAMP, ContextTokens, GeneratedTokens).

    It has arrival times and lengths but no prefix structure, so every request gets block ids
    of its own: nothing is shared, and the trace measures how a policy balances load when
    there is no cache to win (a policy that loses there to least_load pays for its affinity).
    """
    out: list[TraceRequest] = []
    with open(path, newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), 2):
            try:
                t = datetime.fromisoformat(row["TIMESTAMP"]).timestamp()
                input_tokens = max(1, int(row["ContextTokens"]))
                output_tokens = max(1, int(row["GeneratedTokens"]))
            except (KeyError, TypeError, ValueError) as exc:
                what = f"missing column {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ValueError(f"{path}:{lineno}: {what}") from None
            n_blocks = -(-input_tokens // BLOCK_TOKENS)
            head = _chain(0, f"azure:{lineno}")
            out.append(TraceRequest(t, input_tokens, output_tokens,
                                    (head, *(_chain(head, str(i)) for i in range(1, n_blocks)))))
            if limit and len(out) >= limit:
                break
    if out:
        start = min(r.timestamp_s for r in out)
        out = [TraceRequest(r.timestamp_s - start, r.input_tokens, r.output_tokens, r.hash_ids)
               for r in out]
    out.sort(key=lambda r: r.timestamp_s)
    return out


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """A Mooncake JSONL file, a RAGPulse directory, or an Azure CSV."""
    p = Path(path)
    if p.is_dir():
        return load_ragpulse(p, limit)
    if p.suffix.lower() == ".csv":
        return load_azure(p, limit)
    return load_mooncake(p, limit)


# -- prompt text ---------------------------------------------------------------------------


@lru_cache(maxsize=65536)
def block_text(hash_id: int) -> str:
    """The text of a full block: exactly BLOCK_CHARS characters, a pure function of its id."""
    rng = random.Random(hash_id)
    words = rng.choices(WORDS, k=BLOCK_CHARS // 4)
    text = f"[{hash_id}] " + " ".join(words)
    return (text + " " + text)[:BLOCK_CHARS - 1] + "\n"


def prompt_text(req: TraceRequest) -> str:
    """The request's prompt: its blocks' texts in order, the last one cut to its length."""
    parts = [block_text(h) for h in req.hash_ids[:-1]]
    if req.hash_ids:
        last = req.block_tokens(len(req.hash_ids) - 1) * CHARS_PER_TOKEN
        parts.append(block_text(req.hash_ids[-1])[:last])
    return "".join(parts)


# -- reference figures ---------------------------------------------------------------------


def ideal_hit_ratio(requests: Iterable[TraceRequest]) -> float:
    """Token-weighted prefix-chain hit ratio of one infinite cache, in arrival order.

    A block hits when its id (and so, chained, its whole prefix) was seen in any earlier
    request; the walk stops at the first miss, as a paged prefix cache's lookup does.
    """
    seen: set[int] = set()
    hit = total = 0
    for req in requests:
        matching = True
        for i, h in enumerate(req.hash_ids):
            t = req.block_tokens(i)
            total += t
            if matching and h in seen:
                hit += t
            else:
                matching = False
        seen.update(req.hash_ids)
    return hit / total if total else 0.0


def prefix_keys(hash_ids: Sequence[int]) -> list[int]:
    """One key per leading run of block ids: key n stands for the first n + 1 blocks."""
    keys: list[int] = []
    key = 0
    for h in hash_ids:
        key = hash((key, h))
        keys.append(key)
    return keys


def known_prefix(keys: Sequence[int], table: Mapping[int, object]) -> int:
    """How many leading `keys` are in `table` (every prefix of a known prefix is known)."""
    n = 0
    while n < len(keys) and keys[n] in table:
        n += 1
    return n


def agreement(requests: Sequence[TraceRequest],
              replicas: Sequence[str | None]) -> tuple[float | None, int]:
    """How often a warm request went to its prefix's home replica: (agreement, warm requests).

    `replicas[i]` is the replica that served `requests[i]` (None: unknown, or the request
    failed; such a request is neither counted nor anyone's home). In trace order, a request is
    warm when its first block was in an earlier answered request; its longest shared prefix is
    the longest run of leading blocks equal to an earlier answered request's, and its home is
    the replica that served the most recent earlier request sharing that prefix. Agreement =
    warm requests served by their home / warm requests; None when no request is warm.

    Prefixes are compared as whole sequences of block ids, so ids need not be chained.
    """
    if len(requests) != len(replicas):
        raise ValueError(f"{len(requests)} requests but {len(replicas)} replicas")
    # Each prefix (a hash of its block ids, extended block by block) -> the replica of the
    # most recent answered request that began with it.
    home_of: dict[int, str] = {}
    warm = agreed = 0
    for req, served in zip(requests, replicas, strict=True):
        if served is None:
            continue
        keys = prefix_keys(req.hash_ids)
        shared = known_prefix(keys, home_of)
        home = home_of[keys[shared - 1]] if shared else None
        if home is not None:
            warm += 1
            agreed += served == home
        for k in keys:
            home_of[k] = served
    return (agreed / warm if warm else None), warm


OVERFLOW = "overflow"
"""The route reason of a load-bound spill (`x-gateway-route-reason`), which one gateway makes."""


def home_agreement(requests: Sequence[TraceRequest], replicas: Sequence[str | None],
                   reasons: Sequence[str | None] | None = None) -> tuple[float | None, int]:
    """How often a warm request went to one of its prefix's homes: (agreement, warm requests).

    `replicas[i]` served `requests[i]` (None: failed; neither counted nor anyone's home);
    `reasons[i]` is the route reason its gateway gave (None: unknown). In trace order, with
    prefixes compared as whole sequences of block ids: a request is warm when its first block
    was in an earlier answered request, and its longest shared prefix P is the longest run of
    leading blocks equal to an earlier answered request's. It agrees when its replica is one
    of P's homes. Homes are made in turn: the replica that served a prefix first is its home;
    a request that agreed, or that its gateway spilled for load (reason `overflow`, as one
    gateway also does), makes its replica a home of every prefix of its own; any other
    request (sent where its prefix was not, or to a copy only some gateway made) makes its
    replica a home of only the prefixes longer than P, which nobody had before it.
    Agreement = warm requests that agreed / warm requests; None when none is warm.
    """
    if len(requests) != len(replicas) or (reasons is not None and len(reasons) != len(requests)):
        raise ValueError("requests, replicas and reasons differ in length")
    homes: dict[int, set[str]] = {}
    warm = agreed = 0
    for i, (req, served) in enumerate(zip(requests, replicas, strict=True)):
        if served is None:
            continue
        keys = prefix_keys(req.hash_ids)
        shared = known_prefix(keys, homes)
        longest = homes[keys[shared - 1]] if shared else None
        joins_all = longest is None
        if longest is not None:
            warm += 1
            ok = served in longest
            agreed += ok
            joins_all = ok or (reasons is not None and reasons[i] == OVERFLOW)
        for n, k in enumerate(keys, 1):
            if joins_all or n > shared:
                homes.setdefault(k, set()).add(served)
    return (agreed / warm if warm else None), warm


def warm_misses(requests: Sequence[TraceRequest], replicas: Sequence[str | None],
                reasons: Sequence[str | None]) -> dict[str, int]:
    """The warm requests `agreement` counts as misses (not sent to the replica that served
    their longest shared prefix last), by the reason their gateway gave
    (`x-gateway-route-reason`; "unknown" without it), each split by whether the replica
    chosen had served the same longest shared prefix before (`REASON+held`: the prefix had
    several holders and the gateway picked another one) or not (`REASON+new`).

    What each means for several gateways: `cold` is a gateway that saw no holder at all (the
    other gateways' inserts not yet received, or evicted); `overflow` a load spill;
    `affinity+held` a prefix already kept on several replicas, of which the gateway picked one
    that did not serve it last.
    """
    if not len(requests) == len(replicas) == len(reasons):
        raise ValueError("requests, replicas and reasons differ in length")
    home_of: dict[int, str] = {}
    holders: dict[int, set[str]] = {}
    out: dict[str, int] = {}
    for req, served, reason in zip(requests, replicas, reasons, strict=True):
        if served is None:
            continue
        keys = prefix_keys(req.hash_ids)
        shared = known_prefix(keys, home_of)
        last_key = keys[shared - 1] if shared else None
        home = home_of[last_key] if last_key is not None else None
        if home is not None and served != home and last_key is not None:
            held = served in holders.get(last_key, ())
            name = f"{reason or 'unknown'}+{'held' if held else 'new'}"
            out[name] = out.get(name, 0) + 1
        for k in keys:
            home_of[k] = served
            holders.setdefault(k, set()).add(served)
    return dict(sorted(out.items()))


def agreement_figures(requests: Sequence[TraceRequest], replicas: Sequence[str | None],
                      reasons: Sequence[str | None]) -> dict[str, Any]:
    """What a run's served replicas and route reasons say of agreement, as replay reports it:
    `agreement` and `warm_requests` (`home_agreement`), `agreement_last` (`agreement`),
    `warm_miss_reasons` (`warm_misses`) and `spills`, the warm requests among those misses
    that their gateway spilled for load (reason `overflow`)."""
    agreed, warm = home_agreement(requests, replicas, reasons)
    last, _ = agreement(requests, replicas)
    misses = warm_misses(requests, replicas, reasons)
    return {"agreement": agreed, "agreement_last": last, "warm_requests": warm,
            "warm_miss_reasons": misses,
            "spills": sum(n for k, n in misses.items() if k.startswith(OVERFLOW + "+"))}


def shadow_agreement(requests: Sequence[TraceRequest], replicas: Sequence[str | None],
                     picks: Sequence[str | None],
                     matched: Sequence[tuple[int, int] | None] | None = None,
                     held: Sequence[int | None] | None = None) -> dict[str, Any]:
    """How often a warm request went where a shadow single gateway would have sent it:
    `shadow_agreement` (None when none is warm) and `shadow_warm_requests`; with `matched`,
    also `shadow_match_agreement`; with `held`, also `shadow_held_agreement` and
    `shadow_held_requests`.

    `replicas[i]` served `requests[i]` (None: failed) and `picks[i]` is the shadow's choice
    for it. Warm as in `home_agreement`: in trace order, its first block was in an earlier
    answered request. Agreement = warm requests served by the shadow's pick / warm requests.
    `matched[i]` is (blocks of the request the shadow's index held on its pick, on the
    replica that served it); match agreement = warm requests served by the pick or by a
    replica holding as many of their blocks / warm requests: a different replica with as much
    of the prompt cached is the same outcome for the cache, a choice between replicas that
    differ only in load. `held[i]` is the most blocks of the request that the shadow's index
    held on any one replica when it was asked; held agreement = agreement over the warm
    requests of which it held at least one block: a prefix that came before but is cached
    nowhere by then (evicted everywhere) is a cold placement for one gateway too, chosen on
    load alone.
    """
    if not len(requests) == len(replicas) == len(picks):
        raise ValueError("requests, replicas and picks differ in length")
    for name, extra in (("matched", matched), ("held", held)):
        if extra is not None and len(extra) != len(requests):
            raise ValueError(f"requests and {name} differ in length")
    seen: set[int] = set()
    warm = agreed = as_cached = held_warm = held_agreed = 0
    for i, (req, served, pick) in enumerate(zip(requests, replicas, picks, strict=True)):
        if served is None or not req.hash_ids:
            continue
        first = req.hash_ids[0]
        if first in seen:
            warm += 1
            same = served == pick
            agreed += same
            if matched is not None:
                blocks = matched[i]
                as_cached += same or (blocks is not None and blocks[1] >= blocks[0])
            if held is not None and (held[i] or 0) > 0:
                held_warm += 1
                held_agreed += same
        seen.add(first)
    out: dict[str, Any] = {"shadow_agreement": agreed / warm if warm else None,
                           "shadow_warm_requests": warm}
    if matched is not None:
        out["shadow_match_agreement"] = as_cached / warm if warm else None
    if held is not None:
        out["shadow_held_agreement"] = held_agreed / held_warm if held_warm else None
        out["shadow_held_requests"] = held_warm
    return out


def scale_time(requests: list[TraceRequest], speedup: float) -> list[TraceRequest]:
    if speedup == 1.0:
        return requests
    return [TraceRequest(r.timestamp_s / speedup, r.input_tokens, r.output_tokens, r.hash_ids,
                         r.session) for r in requests]


# -- synthetic workloads -------------------------------------------------------------------


def _lognormal_blocks(rng: random.Random, mean: float) -> int:
    """Whole 512-token blocks of a log-normal length (sigma 1) with mean `mean` tokens."""
    tokens = rng.lognormvariate(math.log(mean) - 0.5, 1.0)
    return max(1, round(tokens / BLOCK_TOKENS))


def _ids(seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    while True:
        yield rng.getrandbits(62)


def tenants_workload(n_tenants: int = 150, system_blocks: int = 12, users_per_tenant: int = 5,
                     query_blocks: int = 2, rate_per_s: float = 10.0, n_requests: int = 2000,
                     output_tokens: int = 100, seed: int = 1) -> list[TraceRequest]:
    """Many tenants with long shared contexts (llm-d's B2B benchmark shape).

    Each tenant has a context of `system_blocks` blocks (6,000 tokens at 12 blocks) shared by
    its users; each request adds `query_blocks` fresh blocks. Tenants are drawn uniformly, so
    the KV demand is n_tenants * system_blocks blocks, which should exceed one replica's cache.
    """
    ids = _ids(seed)
    rng = random.Random(seed + 1)
    contexts = [[next(ids) for _ in range(system_blocks)] for _ in range(n_tenants)]
    out, t = [], 0.0
    for i in range(n_requests):
        t += rng.expovariate(rate_per_s)
        tenant = rng.randrange(n_tenants)
        blocks = (*contexts[tenant], *(next(ids) for _ in range(query_blocks)))
        out.append(TraceRequest(t, len(blocks) * BLOCK_TOKENS, output_tokens, blocks,
                                f"t{tenant}-u{i % users_per_tenant}"))
    return out


def hot_prompt_workload(system_blocks: int = 4, user_blocks: int = 1, rate_per_s: float = 20.0,
                        n_requests: int = 2000, output_tokens: int = 100,
                        seed: int = 2) -> list[TraceRequest]:
    """One system prompt shared by every request (the hot-spot case)."""
    ids = _ids(seed)
    rng = random.Random(seed + 1)
    system = [next(ids) for _ in range(system_blocks)]
    out, t = [], 0.0
    for _ in range(n_requests):
        t += rng.expovariate(rate_per_s)
        blocks = (*system, *(next(ids) for _ in range(user_blocks)))
        out.append(TraceRequest(t, len(blocks) * BLOCK_TOKENS, output_tokens, blocks))
    return out


def multi_turn_workload(n_sessions: int = 200, turns: int = 6, system_blocks: int = 2,
                        turn_blocks: int = 2, rate_per_s: float = 8.0, think_time_s: float = 20.0,
                        output_tokens: int = 150, seed: int = 3) -> list[TraceRequest]:
    """Chat sessions whose every turn extends the previous turn's prompt."""
    ids = _ids(seed)
    rng = random.Random(seed + 1)
    systems = [[next(ids) for _ in range(system_blocks)] for _ in range(8)]
    out, start = [], 0.0
    for s in range(n_sessions):
        start += rng.expovariate(rate_per_s / turns)
        blocks = list(systems[s % len(systems)])
        t = start
        for _ in range(turns):
            blocks += [next(ids) for _ in range(turn_blocks)]
            out.append(TraceRequest(t, len(blocks) * BLOCK_TOKENS, output_tokens, tuple(blocks),
                                    f"s{s}"))
            t += rng.expovariate(1.0 / think_time_s)
    out.sort(key=lambda r: r.timestamp_s)
    return out


def conversation_workload(n_sessions: int = 300, rate_per_s: float = 3.0,
                          turns_mean: float = 4.0, first_tokens_mean: float = 8000.0,
                          turn_tokens_mean: float = 1000.0, output_mean: float = 343.0,
                          think_time_s: float = 60.0, seed: int = 5, shared_prefixes: int = 0,
                          shared_tokens: float = 4096.0) -> list[TraceRequest]:
    """Long multi-turn conversations, Mooncake's conversation trace's shape.

    Sessions start as a Poisson process (`rate_per_s` / `turns_mean` per second); each has a
    geometric number of turns (mean `turns_mean`). A first prompt is log-normal (sigma 1,
    mean `first_tokens_mean`); every later turn is the previous prompt, the previous answer
    and a new log-normal user message (mean `turn_tokens_mean`), after an exponential think
    time. Outputs are exponential with mean `output_mean`. Prompts are whole 512-token blocks.
    With `shared_prefixes` > 0, every session starts with one of that many shared prefixes of
    `shared_tokens` tokens (an agent framework's tool definitions), the k-th chosen with
    weight 1/k; the sessions are otherwise the same.
    """
    ids = _ids(seed)
    rng = random.Random(seed + 1)
    # Its own generator, so that sessions without shared prefixes draw as they always did.
    choose = random.Random(seed + 2)
    prefix_blocks = max(1, round(shared_tokens / BLOCK_TOKENS))
    prefixes = [[next(ids) for _ in range(prefix_blocks)] for _ in range(shared_prefixes)]
    weights = [1.0 / k for k in range(1, shared_prefixes + 1)]

    out, start = [], 0.0
    for s in range(n_sessions):
        start += rng.expovariate(rate_per_s / turns_mean)
        blocks = list(choose.choices(prefixes, weights)[0]) if prefixes else []
        t, answer = start, 0
        turns = 1
        while rng.random() > 1.0 / turns_mean:
            turns += 1
        for turn in range(turns):
            mean = first_tokens_mean if turn == 0 else turn_tokens_mean
            new = -(-answer // BLOCK_TOKENS) + _lognormal_blocks(rng, mean)
            blocks += [next(ids) for _ in range(new)]
            answer = max(1, round(rng.expovariate(1.0 / output_mean)))
            out.append(TraceRequest(t, len(blocks) * BLOCK_TOKENS, answer, tuple(blocks),
                                    f"c{s}"))
            t += rng.expovariate(1.0 / think_time_s)
    out.sort(key=lambda r: r.timestamp_s)
    return out


def stress_workload(n_requests: int = 1500, rate_per_s: float = 3.34,
                    input_mean: float = 12035.0, output_mean: float = 343.0, reuse: float = 0.5,
                    seed: int = 1) -> list[TraceRequest]:
    """`loadtests.experiments.stress_trace`'s shapes as a workload (its defaults: Mooncake's
    conversation trace's published rate and mean lengths)."""
    from loadtests.experiments.stress_trace import stress_trace  # it builds on this module

    return [TraceRequest(row["timestamp"] / 1000.0, row["input_length"], row["output_length"],
                         tuple(row["hash_ids"]))
            for row in stress_trace(n_requests, rate_per_s, input_mean, output_mean, reuse,
                                    seed=seed)]


def rag_workload(n_requests: int = 3000, rate_per_s: float = 4.0, n_docs: int = 400,
                 doc_tokens_mean: float = 6000.0, docs_max: int = 3, zipf_s: float = 1.1,
                 question_tokens_mean: float = 200.0, output_mean: float = 250.0,
                 seed: int = 11) -> list[TraceRequest]:
    """Retrieval-augmented requests: each prompt is 1 to `docs_max` retrieved documents,
    drawn by Zipf popularity (exponent `zipf_s`) in the order retrieval ranked them, then a
    fresh question. Documents are log-normal (sigma 1, mean `doc_tokens_mean`); questions
    log-normal too; outputs exponential. Only the prompt's leading documents are a prefix
    another request can share: the same first document, or the same first two."""
    ids = _ids(seed)
    rng = random.Random(seed + 1)

    docs = [[next(ids) for _ in range(_lognormal_blocks(rng, doc_tokens_mean))]
            for _ in range(n_docs)]
    popularity = list(itertools.accumulate(1.0 / (k ** zipf_s) for k in range(1, n_docs + 1)))
    out, t = [], 0.0
    for _ in range(n_requests):
        t += rng.expovariate(rate_per_s)
        chosen: list[int] = []
        for _ in range(rng.randint(1, docs_max)):
            doc = rng.choices(range(n_docs), cum_weights=popularity)[0]
            if doc not in chosen:
                chosen.append(doc)
        content = [h for doc in chosen for h in docs[doc]]
        content += [next(ids) for _ in range(_lognormal_blocks(rng, question_tokens_mean))]
        # Chained, as Mooncake's ids are: a document's blocks after another document are not
        # the blocks it has first in a prompt (its KV depends on what precedes it).
        blocks = _chained(str(c) for c in content)
        output = max(1, round(rng.expovariate(1.0 / output_mean)))
        out.append(TraceRequest(t, len(blocks) * BLOCK_TOKENS, output, tuple(blocks)))
    return out


def swing_rate(t: float, low_rate_per_s: float, high_rate_per_s: float,
               period_s: float) -> float:
    """The swing workload's arrival rate at time `t`: light for the first half of every
    period, heavy for the second."""
    return low_rate_per_s if t % period_s < period_s / 2 else high_rate_per_s


def swing_workload(low_rate_per_s: float = 4.0, high_rate_per_s: float = 16.0,
                   period_s: float = 240.0, duration_s: float = 960.0, n_tenants: int = 200,
                   system_blocks: int = 12, query_blocks: int = 2, output_tokens: int = 100,
                   seed: int = 9) -> list[TraceRequest]:
    """Load that swings: tenants-shaped requests whose Poisson arrival rate switches between
    `low_rate_per_s` and `high_rate_per_s` every `period_s` / 2 seconds (`swing_rate`)."""
    ids = _ids(seed)
    rng = random.Random(seed + 1)
    contexts = [[next(ids) for _ in range(system_blocks)] for _ in range(n_tenants)]
    half = period_s / 2
    out, t = [], 0.0
    while True:
        rate = swing_rate(t, low_rate_per_s, high_rate_per_s, period_s)
        step = rng.expovariate(rate)
        boundary = (t // half + 1) * half
        if t + step >= boundary:
            # Piecewise-constant rate: a Poisson process restarts at each switch (memoryless).
            t = boundary
            if t >= duration_s:
                break
            continue
        t += step
        if t >= duration_s:
            break
        tenant = rng.randrange(n_tenants)
        blocks = (*contexts[tenant], *(next(ids) for _ in range(query_blocks)))
        out.append(TraceRequest(t, len(blocks) * BLOCK_TOKENS, output_tokens, blocks,
                                f"t{tenant}"))
    return out


SYNTHETIC = {
    "tenants": tenants_workload,
    "hot_prompt": hot_prompt_workload,
    "multi_turn": multi_turn_workload,
    "conversation": conversation_workload,
    "stress": stress_workload,
    "swing": swing_workload,
    "rag": rag_workload,
}


def synthetic_workload(name: str, params: dict[str, Any] | None = None) -> list[TraceRequest]:
    """The synthetic workload `name` built with `params`; unknown names or parameters are a
    clear error that lists the valid ones."""
    if name not in SYNTHETIC:
        raise SystemExit(f"unknown workload {name!r}; choose one of {sorted(SYNTHETIC)}")
    build = SYNTHETIC[name]
    known = set(inspect.signature(build).parameters)
    unknown = sorted(set(params or {}) - known)
    if unknown:
        raise SystemExit(f"workload {name} has no parameter {', '.join(unknown)}; "
                         f"its parameters: {', '.join(sorted(known))}")
    return build(**(params or {}))


def load_requests(trace: str | None, workload: str | None, limit: int | None = None,
                  speedup: float = 1.0, params: dict[str, Any] | None = None, *,
                  from_zero: bool = False) -> list[TraceRequest]:
    """The first `limit` requests of a trace file or synthetic workload (built with `params`),
    time-scaled: what replay, compare_http and simulate all send.

    `from_zero` moves the first request to time 0, so a replay does not wait for nothing. The
    simulator keeps the workload's own clock: shifting every time by a constant changes float
    rounding, and with it a few routing ties, so its committed figures would not reproduce.
    """
    if speedup <= 0:
        raise SystemExit("--speedup must be positive")
    if workload:
        reqs = synthetic_workload(workload, params)  # built in time order
        reqs = reqs[:limit] if limit else reqs
    elif trace:
        reqs = load_trace(trace, limit)
    else:
        raise SystemExit("give --trace PATH or --workload NAME")
    if reqs and from_zero:
        t0 = reqs[0].timestamp_s
        reqs = [TraceRequest(r.timestamp_s - t0, r.input_tokens, r.output_tokens, r.hash_ids,
                             r.session) for r in reqs]
    return scale_time(reqs, speedup)
