"""Replica speeds learned from the engines' own prefill metrics (routing/engine_speed.py)."""

from __future__ import annotations

import pytest

from routing.engine_speed import ENGINE_MIN_PREFILLS, EngineSpeeds
from routing.load import LoadTracker


def _serve(speeds: EngineSpeeds, rates: dict[str, float], scrapes: int = 5,
           prefills_per_scrape: int = 10, tokens_each: float = 2000.0,
           interval_s: float = 10.0) -> None:
    """Each replica reports, every `interval_s`, `prefills_per_scrape` prefills of
    `tokens_each` computed tokens at its rate (tokens per second)."""
    for k in range(scrapes + 1):
        for name, rate in rates.items():
            n = k * prefills_per_scrape
            speeds.report(name, k * interval_s, n * tokens_each, n * tokens_each / rate, n)


def test_a_replica_three_times_slower_gets_a_third_of_the_speed() -> None:
    speeds = EngineSpeeds()
    _serve(speeds, {"r0": 30_000.0, "r1": 30_000.0, "r2": 10_000.0, "r3": 31_000.0})
    assert speeds.speeds.get("r2") == pytest.approx(1 / 3, rel=0.02)
    # Within the tolerance of the median, equal engines are equal.
    assert speeds.speeds.get("r0") == speeds.speeds.get("r1") == speeds.speeds.get("r3") == 1.0
    assert speeds.rate("r2") == pytest.approx(10_000.0)


def test_no_speed_until_enough_prefills_nor_with_one_engine_known() -> None:
    speeds = EngineSpeeds()
    # One scrape's worth of prefills short of the minimum.
    short = int(ENGINE_MIN_PREFILLS) - 1
    _serve(speeds, {"r0": 30_000.0, "r1": 10_000.0}, scrapes=1, prefills_per_scrape=short)
    assert speeds.speeds.get("r1") is None and speeds.rate("r1") is None
    alone = EngineSpeeds()
    _serve(alone, {"r0": 30_000.0}, scrapes=3)
    assert alone.rate("r0") == pytest.approx(30_000.0)
    assert alone.speeds.get("r0") is None  # no median to compare it with


def test_overlapping_prefills_count_no_more_than_the_time_between_scrapes() -> None:
    # Ten prefills of 2,000 tokens each reported as 1 s apiece within a 2 s window: they ran
    # side by side, so the engine computed 20,000 tokens in at most 2 s, not in 10.
    speeds = EngineSpeeds()
    for k in range(4):
        speeds.report("r0", 2.0 * k, 20_000.0 * k, 10.0 * k, 10.0 * k)
    assert speeds.rate("r0") == pytest.approx(10_000.0)


def test_a_prefill_longer_than_the_time_between_scrapes_counts_whole() -> None:
    # One 700-token prefill at a time, each taking 7 s, scraped every 0.25 s: each shows in
    # one scrape with its 7 s (a slow engine, or a long prompt). Capped at 0.25 s it read 28
    # times the engine's rate.
    speeds = EngineSpeeds()
    tokens = seconds = count = 0.0
    for k in range(1, 30 * 28 + 1):
        if k % 28 == 0:
            tokens, seconds, count = tokens + 700.0, seconds + 7.0, count + 1.0
        speeds.report("r0", 0.25 * k, tokens, seconds, count)
    assert speeds.rate("r0") == pytest.approx(100.0, rel=0.02)
    # The same prefills 28 at a time, one ending at every scrape: the engine prefills 700
    # tokens per 0.25 s, though each request's own prefill lasted 7 s.
    side_by_side = EngineSpeeds()
    for k in range(1, 40):
        side_by_side.report("r0", 0.25 * k, 700.0 * k, 7.0 * k, float(k))
    assert side_by_side.rate("r0") == pytest.approx(2800.0, rel=0.02)


def test_counters_going_backwards_start_the_rate_again() -> None:
    speeds = EngineSpeeds()
    _serve(speeds, {"r0": 30_000.0, "r1": 10_000.0, "r2": 30_000.0})
    assert speeds.speeds.get("r1") == pytest.approx(1 / 3, rel=0.02)
    speeds.report("r1", 100.0, 0.0, 0.0, 0.0)  # the engine restarted
    assert speeds.rate("r1") is None and speeds.speeds.get("r1") is None
    speeds.report("r0", 100.0, None, None, None)  # a scrape without the figures: no change
    assert speeds.rate("r0") == pytest.approx(30_000.0)
    # Tokens derived from two counters (prompt tokens less cache hits) may dip for a scrape
    # while the histogram moves on: that interval teaches nothing, and forgets nothing.
    speeds.report("r0", 60.0, 99_000.0, 50 * 2000.0 / 30_000.0 + 1.0, 60.0)
    assert speeds.rate("r0") == pytest.approx(30_000.0)


def test_a_replica_that_slows_down_is_seen_to_after_a_few_hundred_of_its_requests() -> None:
    speeds = EngineSpeeds()
    _serve(speeds, {"r0": 30_000.0, "r1": 30_000.0, "r2": 30_000.0})
    assert speeds.speeds.get("r2") == 1.0
    for k in range(1, 61):  # throttled to a third from t = 50 s: 600 more prefills
        for name, rate in {"r0": 30_000.0, "r1": 30_000.0, "r2": 10_000.0}.items():
            n = 50 + 10 * k
            before = 50 * 2000.0 / 30_000.0
            seconds = before + (n - 50) * 2000.0 / rate
            speeds.report(name, 50.0 + 10.0 * k, n * 2000.0, seconds, n)
    assert speeds.speeds.get("r2") == pytest.approx(1 / 3, rel=0.15)


def _pass_through(load: LoadTracker, names: tuple[str, ...], rounds: int = 1) -> None:
    """Requests to each replica, each passed through whole: no first token seen."""
    for _ in range(rounds):
        for name in names:
            load.dispatched(name, 2000.0)
            load.finished(name, 2000.0, False)


def test_with_nothing_streamed_a_replica_is_priced_at_its_engines_speed() -> None:
    load = LoadTracker()
    _serve(load.engines, {"r0": 30_000.0, "r1": 30_000.0, "r2": 10_000.0})
    # No request has ended yet: nothing says the gateway's timing is blind.
    assert load.view("r2").speed == 1.0
    _pass_through(load, ("r0", "r1", "r2"))
    # Every request passed through: the gateway timed nothing, the engines' metrics decide.
    assert load.view("r2").speed == pytest.approx(1 / 3, rel=0.02)
    assert load.view("r0").speed == 1.0
    off = LoadTracker(engine_speed=False)
    _serve(off.engines, {"r0": 30_000.0, "r1": 30_000.0, "r2": 10_000.0})
    _pass_through(off, ("r0", "r1", "r2"))
    assert off.view("r2").speed == 1.0
    # With a configured prefill rate every replica is priced alike, as with timed speeds.
    fixed = LoadTracker(prefill_tokens_per_s=20_000.0)
    _serve(fixed.engines, {"r0": 30_000.0, "r1": 30_000.0, "r2": 10_000.0})
    _pass_through(fixed, ("r0", "r1", "r2"))
    assert fixed.view("r2").speed == 1.0


def _stream(load: LoadTracker, names: tuple[str, ...], t: float, rounds: int = 1) -> float:
    """A cold prompt to each replica in turn, sent while it is idle, its first token streamed
    0.1 s later: the replica's prefill timed whole (a sample of its own rate). The time
    after."""
    for _ in range(rounds):
        for name in names:
            load.dispatched(name, 2000.0, t)
            load.chunk(name, t + 0.1)
            load.first_token(name, 2000.0, t + 0.1, t, cold=True)
            load.finished(name, 2000.0, True)
            t += 1.0
    return t


def test_with_every_request_streamed_the_gateways_own_timing_decides() -> None:
    # The engines say r2 is a third as fast; the gateway's own timing of every request says
    # it is as fast as the others. Seeing all the work, the gateway's is the finer signal.
    load = LoadTracker()
    _serve(load.engines, {"r0": 30_000.0, "r1": 30_000.0, "r2": 10_000.0})
    _stream(load, ("r0", "r1", "r2"), 0.0, rounds=2)
    assert load.steps.replica_rate("r2") == pytest.approx(20_000.0)
    assert load.view("r2").speed == 1.0


def test_engines_of_one_kind_share_one_speed_and_scatter_within_a_kind_is_ignored() -> None:
    # Two GPU generations, four engines each: every engine's own rate strays a little. The
    # median of the eight falls between the kinds; each kind takes its own median's speed.
    speeds = EngineSpeeds()
    fast = {"r0": 17_500.0, "r1": 17_900.0, "r2": 17_200.0, "r3": 17_800.0}
    slow = {"r4": 5_700.0, "r5": 5_800.0, "r6": 5_900.0, "r7": 5_750.0}
    _serve(speeds, {**fast, **slow})
    middle = (17_200.0 + 5_900.0) / 2
    for name in fast:
        assert speeds.speeds[name] == pytest.approx(17_650.0 / middle)
    for name in slow:
        assert speeds.speeds[name] == pytest.approx(5_775.0 / middle)
    # Equal engines, 15% apart at most: one group, every speed 1.
    equal = EngineSpeeds()
    _serve(equal, {"r0": 26_000.0, "r1": 30_000.0, "r2": 34_000.0, "r3": 29_000.0})
    assert {equal.speeds[n] for n in ("r0", "r1", "r2", "r3")} == {1.0}


def test_with_much_of_the_traffic_passed_through_the_engines_speeds_win() -> None:
    # The gateway timed r2 as fast as the others, from its streamed requests; but as many
    # again were passed through whole, prefilled in the steps it timed and unseen: its own
    # rates are blind to that work, and the engines' speeds are used instead.
    load = LoadTracker()
    _serve(load.engines, {"r0": 30_000.0, "r1": 30_000.0, "r2": 10_000.0})
    t = _stream(load, ("r0", "r1", "r2"), 0.0, rounds=2)
    assert load.view("r2").speed == 1.0  # streamed only: what the gateway timed
    _pass_through(load, ("r0", "r1", "r2"), rounds=2)
    assert load.view("r2").speed == pytest.approx(1 / 3, rel=0.02)
    # Streamed again, for long enough that the passed-through share falls below a tenth.
    _stream(load, ("r0", "r1", "r2"), t, rounds=20)
    assert load.view("r2").speed == 1.0


def test_priced_at_its_engines_speed_a_replica_has_no_busy_throughput_stand_in() -> None:
    # First tokens with no engine step timed (as a gateway relaying another's streams sees
    # them) give each replica a throughput while busy, which stands in for a speed not yet
    # learned (`busy_speed`). Once the engines' speeds price the replicas, the speed is
    # known: the stand-in goes, as it does once the gateway learns a rate of its own.
    load = LoadTracker()
    _serve(load.engines, {"r0": 30_000.0, "r1": 30_000.0, "r2": 10_000.0})
    t = 0.0
    for _ in range(12):
        for name in ("r0", "r1", "r2"):
            load.dispatched(name, 2000.0, t)
            load.first_token(name, 2000.0, t + 0.1, t)
            load.finished(name, 2000.0, True)
            t += 1.0
    assert load.steps.replica_rate("r2") is None
    assert load.view("r2").busy_speed == 1.0 and load.view("r2").speed == 1.0
    _pass_through(load, ("r0", "r1", "r2"), rounds=2)
    view = load.view("r2")
    assert view.speed == pytest.approx(1 / 3, rel=0.02) and view.busy_speed is None
