"""Fleet specs: which latency profile, at which slowdown, each simulated replica of a pool runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backends.sim.profiles import PROFILES, LatencyProfile

FLEET_HELP = ("replicas of mixed speeds, in order: PROFILE[/SLOWDOWN][:COUNT],... (e.g. "
              "llama-8b-h200:4,qwen-32b-h200:4, or qwen-32b-h200:7,qwen-32b-h200/3:1); sets "
              "the replica count")
SLOW_HELP = "N:F: the last N replicas run F times slower than their profile (e.g. 1:3)"


@dataclass(frozen=True, slots=True)
class ReplicaProfile:
    """One replica's latency: a named profile, run `slowdown` times slower."""

    profile: str
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: "
                             f"{', '.join(sorted(PROFILES))}")
        if not self.slowdown > 0:
            raise ValueError(f"slowdown must be positive, not {self.slowdown!r}")

    @property
    def label(self) -> str:
        return self.profile if self.slowdown == 1.0 else f"{self.profile}/{self.slowdown:g}"

    def build(self) -> LatencyProfile:
        return PROFILES[self.profile].slowed(self.slowdown)


def _number(text: str, what: str, entry: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} in {entry!r} is not a number") from None


def parse_fleet(spec: str) -> list[ReplicaProfile]:
    """`PROFILE[/SLOWDOWN][:COUNT],...` -> one ReplicaProfile per replica, in order."""
    out: list[ReplicaProfile] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            raise ValueError(f"empty entry in fleet spec {spec!r}")
        head, sep, count_text = entry.partition(":")
        count = 1
        if sep:
            value = _number(count_text, "count", entry)
            if value != int(value) or value < 1:
                raise ValueError(f"count {count_text!r} in {entry!r} must be a whole number >= 1")
            count = int(value)
        name, sep, slow_text = head.partition("/")
        slowdown = _number(slow_text, "slowdown", entry) if sep else 1.0
        out += [ReplicaProfile(name, slowdown)] * count
    return out


def apply_slow(fleet: Sequence[ReplicaProfile], spec: str) -> list[ReplicaProfile]:
    """`N:F`: the last N replicas of `fleet` run F times slower (on top of any slowdown)."""
    n_text, sep, f_text = spec.partition(":")
    if not sep:
        raise ValueError(f"--slow {spec!r}: expected N:F, e.g. 1:3")
    n = _number(n_text, "replica count", spec)
    factor = _number(f_text, "slowdown", spec)
    if n != int(n) or not 1 <= n <= len(fleet):
        raise ValueError(f"--slow {spec!r}: N must be a whole number from 1 to {len(fleet)}")
    if not factor > 0:
        raise ValueError(f"--slow {spec!r}: the slowdown must be positive")
    cut = len(fleet) - int(n)
    return [*fleet[:cut], *(ReplicaProfile(r.profile, r.slowdown * factor) for r in fleet[cut:])]


def fleet_profiles(replicas: int | None, profile: str, fleet: str | None = None,
                   slow: str | None = None) -> list[ReplicaProfile]:
    """Each replica's profile from the command line: `fleet` if given (its count must agree
    with `replicas` when that is given too), else `replicas` x `profile`; then `slow`."""
    if fleet:
        out = parse_fleet(fleet)
        if replicas is not None and replicas != len(out):
            raise ValueError(f"--replicas {replicas} disagrees with the fleet spec's "
                             f"{len(out)} replicas")
    else:
        if replicas is not None and replicas < 1:
            raise ValueError("--replicas must be at least 1")
        out = [ReplicaProfile(profile)] * (8 if replicas is None else replicas)
    return apply_slow(out, slow) if slow else out


def describe(fleet: Sequence[ReplicaProfile]) -> str:
    """`4 x llama-8b-h200 + 4 x qwen-32b-h200`, runs of equal profiles in order."""
    runs: list[list] = []
    for r in fleet:
        if runs and runs[-1][0] == r.label:
            runs[-1][1] += 1
        else:
            runs.append([r.label, 1])
    return " + ".join(f"{n} x {label}" for label, n in runs)


def is_uniform(fleet: Sequence[ReplicaProfile]) -> bool:
    return len({r.label for r in fleet}) <= 1
