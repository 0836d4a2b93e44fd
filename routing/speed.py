"""Per-replica speed as a policy prices it: prefill tokens at a replica's own learned rate."""

from __future__ import annotations

from routing.types import ReplicaView


class SpeedBook:
    """The speed each replica last showed (`ReplicaView.speed`), for pricing work there.

    A policy divides the prefill queued on a replica, and the prefill it recently sent there,
    by the replica's speed: on a pool of mixed speeds a replica three times slower counts its
    queue three times over, since it takes three times as long to drain, and so gets a third of
    the work. Disabled, every speed is 1.
    """

    __slots__ = ("_last", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._last: dict[str, float] = {}

    def see(self, view: ReplicaView) -> float:
        """The speed to price `view`'s work at now; remembered for `time_of`."""
        if not self.enabled:
            return 1.0
        speed = view.speed if view.speed > 0.0 else 1.0
        if speed != 1.0 or view.name in self._last:
            self._last[view.name] = speed
        return speed

    def time_of(self, replica: str, tokens: float) -> float:
        """`tokens` of prefill on `replica`, in the pool's tokens (its last seen speed)."""
        return tokens / self._last.get(replica, 1.0)

    def forget(self, replica: str) -> None:
        self._last.pop(replica, None)
