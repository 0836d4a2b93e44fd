"""Unit tests of routing/: hashing, the prefix index, and the policies' promises."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from routing import LoadTracker, PrefixIndex, Router, build_policy, char_block_hashes
from routing.load import sum_loads
from routing.policies import load_bound
from routing.prompt import render_chat
from routing.steps import SPEED_TOLERANCE, StepTimer, sum_rates
from routing.types import (
    REASON_AFFINITY,
    REASON_COLD,
    REASON_OVERFLOW,
    Decision,
    ReplicaView,
    RoutingRequest,
)

REPLICAS = ["r0", "r1", "r2", "r3"]


def system_prompt(i: int, chars: int = 2000) -> str:
    words = [f"tenant{i}-word{j}" for j in range(chars // 10)]
    return " ".join(words)[:chars]


def chat_text(system: str, user: str) -> str:
    return render_chat({"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": user}]})


def make_router(policy: str = "prefix_affinity", replicas=REPLICAS, **params) -> Router:
    return Router(replicas, build_policy(policy, params), block_chars=128)


def idle(names=REPLICAS) -> list[ReplicaView]:
    return [ReplicaView(name=n) for n in names]


def test_chained_hashes_share_exactly_the_common_prefix() -> None:
    a = char_block_hashes("x" * 300 + "AAAA" + "y" * 300, 100)
    b = char_block_hashes("x" * 300 + "BBBB" + "y" * 300, 100)
    assert len(a) == len(b) == 6
    assert a[:3] == b[:3]
    # Every block after the first difference differs, even where the bytes are equal again.
    assert all(x != y for x, y in zip(a[3:], b[3:], strict=True))


def test_partial_trailing_block_is_not_hashed() -> None:
    assert len(char_block_hashes("z" * 250, 100)) == 2
    assert len(char_block_hashes("z" * 250, 100, include_partial=True)) == 3


def test_tools_change_the_rendered_prefix() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    plain = render_chat({"messages": msgs})
    with_tools = render_chat({"messages": msgs, "tools": [{"type": "function", "function": {
        "name": "f"}}]})
    assert plain != with_tools
    assert not with_tools.startswith(plain)


def test_prefix_index_lru_evicts_chain_tails_first() -> None:
    index = PrefixIndex(capacity_blocks=4)
    first = [1, 2, 3]
    index.insert(first)
    index.insert([10, 11, 12])
    # Capacity 4: the newer chain fits whole, the older one keeps only its head.
    assert index.match([10, 11, 12]) == 3
    assert index.match(first) == 1
    assert len(index) == 4


def test_prefix_index_keeps_pinned_blocks_until_the_last_unpin() -> None:
    index = PrefixIndex(capacity_blocks=4)
    running = [1, 2, 3]
    index.insert(running)
    index.pin(running)
    index.pin(running)  # two requests running on the same prefix
    index.insert([10, 11, 12, 13])
    # Pinned blocks take their share of the capacity, as in the engine, and are not evicted:
    # of the newer chain only its head fits beside them.
    assert index.match(running) == 3
    assert index.match([10, 11, 12, 13]) == 1
    index.unpin(running)
    index.insert([20, 21, 22, 23])
    assert index.match(running) == 3  # one request still holds it
    assert index.match([10, 11, 12, 13]) == 0
    index.unpin(running)
    # Released as the most recent, tail first: a newer chain evicts its tail before its head.
    index.insert([30, 31])
    assert index.match(running) == 2
    assert index.match([20, 21, 22, 23]) == 0
    assert len(index) == 4


def test_prefix_index_lends_room_to_blocks_not_computed_yet() -> None:
    index = PrefixIndex(capacity_blocks=4)
    index.insert([1, 2, 3, 4])
    index.room = 2  # two blocks sent there are still queued: the engine does not hold them
    index.insert([10, 11])
    assert index.match([1, 2, 3, 4]) == 4 and index.match([10, 11]) == 2
    index.room = 0  # computed: now they push out the oldest
    index.insert([])
    assert index.match([10, 11]) == 2 and index.match([1, 2, 3, 4]) == 2
    assert len(index) == 4


def test_a_finished_requests_output_is_evicted_after_older_prefixes_and_before_its_prompt(
) -> None:
    def after_a_request_with(output_blocks: int) -> PrefixIndex:
        index = PrefixIndex(capacity_blocks=5)
        index.insert([10])  # an older prefix
        index.insert([1, 2])
        index.pin([1, 2])
        index.unpin([1, 2], output_blocks=output_blocks)
        index.insert([20])  # a newer one pushes out what is least recent
        return index

    assert after_a_request_with(0).match([10]) == 1
    index = after_a_request_with(2)
    # The output took the room the older prefix had; the request's prompt is kept whole.
    assert index.match([10]) == 0 and index.match([1, 2]) == 2 and len(index) == 5
    index.insert([30, 40])  # the output's two blocks go next, still before the prompt
    assert index.match([1, 2]) == 2
    index.insert([50])
    assert index.match([1, 2]) == 1  # then the prompt, tail first
    assert index.pinned_blocks == 0


def test_a_router_with_output_cached_leaves_the_tokens_a_request_generated_in_its_index(
) -> None:
    for cached, grown in ((True, 3), (False, 0)):
        router = Router(["r0"], build_policy("prefix_affinity", {}), block_chars=128,
                        index_capacity_blocks=64, pin_running=True, output_cached=cached)
        request, decision = route_and_start(router, chat_text(system_prompt(1), "turn 1"))
        held = len(router.indexes["r0"])
        # 128 characters at 4 characters a token: 32 tokens a block; 100 tokens fill 3.
        router.finished(decision, True, output_tokens=100)
        assert len(router.indexes["r0"]) == held + grown
        assert router.indexes["r0"].match(request.hashes) == len(request.hashes)
    # An attempt that never saw its first token generated nothing and leaves nothing.
    router = Router(["r0"], build_policy("prefix_affinity", {}), block_chars=128,
                    index_capacity_blocks=64, pin_running=True, output_cached=True)
    request = router.request_from_text(chat_text(system_prompt(2), "turn 1"))
    decision = router.route(request, [ReplicaView(name="r0")])
    router.finished(decision, False, output_tokens=100)
    assert len(router.indexes["r0"]) == len(request.hashes)


def one_small_replica(pin_running: bool, output_cached: bool = False) -> Router:
    return Router(["r0"], build_policy("prefix_affinity", {}), block_chars=128,
                  index_capacity_blocks=64, pin_running=pin_running,
                  output_cached=output_cached)


def route_and_start(router: Router, text: str) -> tuple[RoutingRequest, Decision]:
    """Route `text` to the one replica, send it and see its first token."""
    request = router.request_from_text(text)
    decision = router.route(request, [ReplicaView(name="r0")])
    router.dispatched(decision, 0.0)
    router.first_token(decision, 1.0, 0.0)
    return request, decision


def flood(router: Router, n: int, first: int = 100) -> None:
    """Route `n` other conversations (15 blocks each) to the one replica (64 blocks)."""
    for i in range(first, first + n):
        router.route(router.request_from_text(chat_text(system_prompt(i), "q")),
                     [ReplicaView(name="r0")])


def test_a_running_requests_prefix_outlives_the_index_capacity_until_it_finishes() -> None:
    for pin in (True, False):
        router = one_small_replica(pin)
        long_context, decision = route_and_start(router, chat_text(system_prompt(1), "turn 1"))
        # Other conversations sent there meanwhile fill the index several times over.
        flood(router, 8)
        held = router.matched_blocks("r0", long_context.hashes)
        if pin:
            # The engine is still computing this context: its blocks are in use and stay.
            assert held == len(long_context.hashes)
            router.finished(decision, True)
            flood(router, 8)
            assert router.matched_blocks("r0", long_context.hashes) == 0
        else:
            assert held == 0


def shared_pair(pin: bool, output_cached: bool = False) -> tuple[Router, Router]:
    """Two gateways' routers of one small replica, `a`'s inserts and releases applied to `b`
    at once (as from gateway "a")."""
    a, b = one_small_replica(pin, output_cached), one_small_replica(pin, output_cached)
    a.on_record = lambda replica, hashes, cost, held, output: b.apply_remote_inserts(
        [(replica, hashes, cost, held, output)], "a")
    a.on_release = lambda replica, last, cached: b.apply_remote_releases(
        "a", [(replica, last)], [cached])
    return a, b


def test_another_gateways_finished_request_leaves_its_output_in_this_index_too() -> None:
    """With `output_cached`, the engine keeps what a request generated whichever gateway
    sent it: the other gateways' indexes keep it too, after older prefixes and before the
    request's prompt, as the index of the gateway that sent it does."""
    a, b = shared_pair(True, output_cached=True)
    older, older_decision = route_and_start(a, chat_text(system_prompt(1), "q"))  # 15 blocks
    a.finished(older_decision, True)
    request, decision = route_and_start(a, chat_text(system_prompt(2), "q"))
    held = len(b.indexes["r0"])
    assert held == len(a.indexes["r0"]) == 30
    # 32 tokens a block: 1,000 generated tokens fill 31 blocks; with the 30 of the two
    # prompts that is 61 of 64, and the older prefix's tail goes as the next one runs.
    a.finished(decision, True, output_tokens=1000)
    assert len(b.indexes["r0"]) == len(a.indexes["r0"]) == held + 31
    route_and_start(a, chat_text(system_prompt(3), "q"))
    for router in (a, b):
        assert router.matched_blocks("r0", request.hashes) == len(request.hashes)
        assert router.matched_blocks("r0", older.hashes) == 15 - 12
    # Without the setting, and from a gateway that does not send them, none are kept.
    a, b = shared_pair(True, output_cached=False)
    _, decision = route_and_start(a, chat_text(system_prompt(2), "q"))
    a.finished(decision, True, output_tokens=1000)
    assert len(b.indexes["r0"]) == len(a.indexes["r0"]) == 15
    b = one_small_replica(True, output_cached=True)
    a.on_record = lambda replica, hashes, cost, held, output: b.apply_remote_inserts(
        [(replica, hashes, cost, held, output)], "a")
    _, decision = route_and_start(a, chat_text(system_prompt(3), "q"))
    assert b.apply_remote_releases("a", [("r0", decision.hashes[-1])]) == 1
    assert len(b.indexes["r0"]) == 15


def start_with_output(router: Router, text: str, output_blocks: int) -> Decision:
    """Route `text` to the one replica with a max_tokens of `output_blocks` blocks, send it
    and see its first token."""
    request = router.request_from_text(text)
    request.output_tokens = output_blocks * request.block_tokens
    decision = router.route(request, [ReplicaView(name="r0")])
    router.dispatched(decision, 0.0)
    router.first_token(decision, 1.0, 0.0)
    return decision


def test_a_running_requests_output_takes_room_from_its_index_until_it_ends() -> None:
    """An engine keeps KV for a running request's output beside its prompt: with
    `pin_running`, the index holds that much less of the prefixes sent there, from the
    decision until the request ends."""
    for pin in (True, False):
        router = one_small_replica(pin)
        earlier, d = route_and_start(router, chat_text(system_prompt(1), "q"))  # 15 blocks
        router.finished(d, True)
        queued = router.request_from_text(chat_text(system_prompt(2), "q"))
        queued.output_tokens = 40 * queued.block_tokens
        decision = router.route(queued, [ReplicaView(name="r0")])
        router.dispatched(decision, 2.0)
        assert decision.output_blocks == (40 if pin else 0)
        assert router.indexes["r0"].reserved == decision.output_blocks
        # Queued, its prompt is lent room: nothing is evicted yet.
        assert router.matched_blocks("r0", earlier.hashes) == len(earlier.hashes)
        router.first_token(decision, 3.0, 2.0)
        if not pin:
            assert router.matched_blocks("r0", earlier.hashes) == len(earlier.hashes)
            continue
        # Running: 15 + 15 prompt blocks and 40 of output in 64, the oldest prefix's tail goes.
        assert router.matched_blocks("r0", earlier.hashes) == 64 - 40 - 15
        router.finished(decision, True)
        assert router.indexes["r0"].reserved == 0
        # A request that sets no max_tokens reserves nothing; one abandoned while queued
        # gives back what it reserved.
        unlimited = start_with_output(router, chat_text(system_prompt(3), "q"), 0)
        assert unlimited.output_blocks == 0 and router.indexes["r0"].reserved == 0
        request = router.request_from_text(chat_text(system_prompt(4), "q"))
        request.output_tokens = 20 * request.block_tokens
        abandoned = router.route(request, [ReplicaView(name="r0")])
        assert router.indexes["r0"].reserved == 20
        router.finished(abandoned, False)
        assert router.indexes["r0"].reserved == 0


def test_another_gateways_running_request_holds_room_for_its_output_here_until_it_ends() -> None:
    a, b = shared_pair(True)
    text = chat_text(system_prompt(1), "q")
    first = start_with_output(a, text, 40)
    second = start_with_output(a, text, 10)  # the same prefix, a shorter output
    assert b.indexes["r0"].reserved == 50 == a.indexes["r0"].reserved
    # Releases name the prefix: the first gives back an even share, the last the rest.
    a.finished(first, True)
    assert b.indexes["r0"].reserved == 25 and a.indexes["r0"].reserved == 10
    a.finished(second, True)
    assert b.indexes["r0"].reserved == 0 == a.indexes["r0"].reserved
    # A gateway that leaves gives back what its running requests held.
    start_with_output(a, chat_text(system_prompt(2), "q"), 30)
    assert b.indexes["r0"].reserved == 30
    assert b.release_remote_pins("a") == 1
    assert b.indexes["r0"].reserved == 0


def test_another_gateways_running_request_keeps_its_prefix_in_this_index_until_it_ends() -> None:
    """With pins shared, a gateway keeps in its index the prefix another gateway's request
    holds on the engine while it runs, as that gateway does: the engine still has it, and
    the next turn routed here should find it."""
    for pin in (True, False):
        a, b = shared_pair(pin)
        context, decision = route_and_start(a, chat_text(system_prompt(1), "turn 1"))
        assert b.matched_blocks("r0", context.hashes) == len(context.hashes)
        flood(b, 8)  # b's own conversations fill its index several times over meanwhile
        held = b.matched_blocks("r0", context.hashes)
        if not pin:
            assert held == 0 and b.remote_pins() == 0
            continue
        assert held == len(context.hashes) and b.remote_pins("a") == 1
        a.finished(decision, True)  # its end released it: b may let it go again
        assert b.remote_pins() == 0
        flood(b, 8, first=200)
        assert b.matched_blocks("r0", context.hashes) == 0


def test_a_request_abandoned_before_its_first_token_releases_what_it_held_elsewhere() -> None:
    a, b = shared_pair(True)
    request = a.request_from_text(chat_text(system_prompt(1), "q"))
    decision = a.route(request, [ReplicaView(name="r0")])
    a.dispatched(decision, 0.0)
    assert b.remote_pins("a") == 1  # pinned from the decision on: it is queued there
    a.finished(decision, False)
    assert b.remote_pins() == 0 and b.indexes["r0"].pinned_blocks == 0


def test_pins_of_a_gateway_that_leaves_are_released_and_a_stray_release_is_ignored() -> None:
    a, b = shared_pair(True)
    first, _ = route_and_start(a, chat_text(system_prompt(1), "q"))
    second, _ = route_and_start(a, chat_text(system_prompt(2), "q"))
    # The same prefix on the same replica twice: held until both requests end.
    route_and_start(a, chat_text(system_prompt(2), "q"))
    assert b.remote_pins("a") == 3
    assert b.apply_remote_releases("a", [("r0", 12345), ("r9", second.hashes[-1])]) == 0
    assert b.apply_remote_releases("nobody", [("r0", first.hashes[-1])]) == 0
    assert b.apply_remote_releases("a", [("r0", second.hashes[-1])]) == 1
    assert b.matched_blocks("r0", second.hashes) == len(second.hashes)  # one still runs
    assert b.release_remote_pins("a") == 2
    assert b.remote_pins() == 0 and b.indexes["r0"].pinned_blocks == 0
    flood(b, 8)
    assert b.matched_blocks("r0", first.hashes) == 0


def test_pins_another_gateway_never_releases_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import routing.router as router_module

    monkeypatch.setattr(router_module, "REMOTE_PINS_PER_SOURCE", 2)
    a, b = shared_pair(True)
    prompts = [route_and_start(a, chat_text(system_prompt(i), "q"))[0] for i in range(3)]
    # Its releases were lost: the oldest pin went to make room for the third.
    assert b.remote_pins("a") == 2
    flood(b, 8)
    assert [b.matched_blocks("r0", p.hashes) == len(p.hashes) for p in prompts] == [
        False, True, True]


def test_prefill_still_queued_does_not_push_out_what_the_engine_holds() -> None:
    for pin in (True, False):
        router = one_small_replica(pin)
        answered, d = route_and_start(router, chat_text(system_prompt(1), "q"))
        router.finished(d, True)
        # Six other prompts sent and still queued there: the engine has not computed them,
        # so they have not evicted anything from its cache yet.
        for i in range(6):
            queued = router.route(router.request_from_text(chat_text(system_prompt(200 + i), "q")),
                                  [ReplicaView(name="r0")])
            router.dispatched(queued, 2.0)
        held = router.matched_blocks("r0", answered.hashes)
        assert held == (len(answered.hashes) if pin else 0)


def test_once_the_queued_prefill_is_computed_it_pushes_out_what_was_held_for_it() -> None:
    router = one_small_replica(True)
    answered, d = route_and_start(router, chat_text(system_prompt(1), "q"))
    router.finished(d, True)
    queued = []
    for i in range(6):
        decision = router.route(router.request_from_text(chat_text(system_prompt(200 + i), "q")),
                                [ReplicaView(name="r0")])
        router.dispatched(decision, 2.0)
        queued.append(decision)
    assert router.matched_blocks("r0", answered.hashes) == len(answered.hashes)
    # The engine computes them: now in its cache, they evicted the older prefix. The index
    # forgets it then, not at the next request it routes there.
    for decision in queued:
        router.first_token(decision, 3.0, 2.0)
    assert router.load.pending_prefill["r0"] == 0
    assert router.indexes["r0"].room == 0
    assert router.matched_blocks("r0", answered.hashes) == 0
    for decision in queued:
        router.finished(decision, True)
    assert len(router.indexes["r0"]) == 64


def test_a_request_abandoned_while_queued_gives_back_the_room_it_was_lent() -> None:
    router = one_small_replica(True)
    _, d = route_and_start(router, chat_text(system_prompt(1), "q"))
    router.finished(d, True)
    queued = [router.route(router.request_from_text(chat_text(system_prompt(200 + i), "q")),
                           [ReplicaView(name="r0")]) for i in range(6)]
    for decision in queued:
        router.dispatched(decision, 2.0)
    assert router.indexes["r0"].room > 0
    for decision in queued:  # cancelled by their clients before any token
        router.finished(decision, False)
    assert router.indexes["r0"].room == 0
    assert len(router.indexes["r0"]) == 64


def test_other_gateways_prefill_computed_there_pushes_out_what_was_held_for_it() -> None:
    router = one_small_replica(True)
    old, d = route_and_start(router, chat_text(system_prompt(1), "q"))
    router.finished(d, True)
    # Other gateways sent six prompts there, still queued: 6 x 40 blocks of prefill.
    block_tokens = router.block_chars / router.chars_per_token
    router.apply_remote_load({"r0": (6, 240 * block_tokens, 240 * block_tokens, 1, 0.0)})
    for i in range(6):
        theirs = router.request_from_text(chat_text(system_prompt(200 + i), "q"))
        router.apply_remote_inserts([("r0", theirs.hashes, theirs.prompt_tokens)])
    assert router.matched_blocks("r0", old.hashes) == len(old.hashes)
    router.apply_remote_load({"r0": (6, 0.0, 0.0, 0, 0.0)})  # computed
    assert router.matched_blocks("r0", old.hashes) == 0


def test_the_room_for_queued_prefill_is_counted_in_the_requests_own_blocks() -> None:
    # Hashed on the engine's tokens (16 per block), not on characters: the room lent to the
    # prefill still queued is that many blocks, not the characters' count of them.
    router = Router(["r0"], build_policy("prefix_affinity", {}), index_capacity_blocks=64,
                    pin_running=True)
    view = [ReplicaView(name="r0")]

    def tokens_request(first: int) -> RoutingRequest:
        return router.request_from_hashes(list(range(first, first + 16)), 256.0, 16.0)

    answered = tokens_request(0)
    d = router.route(answered, view)
    router.dispatched(d, 0.0)
    router.first_token(d, 1.0, 0.0)
    router.finished(d, True)
    for i in range(1, 7):  # 96 more blocks sent there, none computed yet
        router.dispatched(router.route(tokens_request(1000 * i), view), 2.0)
    assert router.matched_blocks("r0", answered.hashes) == 16


def test_identical_prefixes_go_to_the_same_replica() -> None:
    router = make_router()
    sys_prompt = system_prompt(1)
    chosen = set()
    for u in range(10):
        req = router.request_from_text(chat_text(sys_prompt, f"question {u}"))
        decision = router.route(req, idle())
        chosen.add(decision.replica)
    assert len(chosen) == 1
    # After the first request, the rest are affinity hits on the whole system prompt.
    assert decision.reason == REASON_AFFINITY
    assert decision.matched_blocks >= 2000 // 128


def test_distinct_cold_prefixes_spread_over_replicas() -> None:
    router = make_router()
    homes = Counter()
    for i in range(64):
        req = router.request_from_text(chat_text(system_prompt(i), "hello"))
        d = router.route(req, idle())
        assert d.reason == REASON_COLD
        homes[d.replica] += 1
    # Rendezvous homes: every replica owns some prefixes (64 keys over 4 replicas).
    assert set(homes) == set(REPLICAS)
    assert max(homes.values()) <= 2 * 64 / len(REPLICAS)


@pytest.mark.parametrize("system_chars", [2000, 80000])
def test_hot_prefix_under_load_spreads_and_respects_the_bound(system_chars: int) -> None:
    # The pure bound: no allowance, none earned by a long match (80,000 characters are
    # about 20,000 tokens, which at the default match_allowance_tokens would earn 2 more),
    # and no time cap (which outranks the bound where it leaves only busier replicas).
    router = make_router(load_factor=1.25, load_allowance=0, match_allowance_tokens=None,
                         time_cap=None)
    load = router.load
    sys_prompt = system_prompt(7, system_chars)
    served = Counter()
    reasons = Counter()
    # 40 concurrent requests that never finish: the hottest possible prefix.
    for u in range(40):
        views = [load.view(n) for n in REPLICAS]
        bound = load_bound(views, 1.25)
        req = router.request_from_text(chat_text(sys_prompt, f"user {u}"))
        d = router.route(req, views)
        assert load.inflight.get(d.replica, 0) + 1 <= bound
        router.dispatched(d)
        served[d.replica] += 1
        reasons[d.reason] += 1
    assert len(served) > 1
    assert max(served.values()) <= -(-1.25 * 40 // len(REPLICAS))
    assert reasons[REASON_OVERFLOW] > 0


def test_two_independent_routers_agree_on_cold_prefixes() -> None:
    a, b = make_router(), make_router()
    for i in range(32):
        text = chat_text(system_prompt(100 + i), "q")
        da = a.route(a.request_from_text(text), idle())
        # The second router lists its replicas in another order: names decide, not positions.
        db = b.route(b.request_from_text(text), idle(list(reversed(REPLICAS))))
        assert da.replica == db.replica


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "consistent_hash"])
def test_baseline_policies_choose_only_given_replicas(policy: str) -> None:
    router = make_router(policy)
    seen = Counter()
    for i in range(40):
        d = router.route(router.request_from_text(chat_text(system_prompt(i % 5), str(i))),
                         idle(REPLICAS[:3]))
        seen[d.replica] += 1
    assert set(seen) <= set(REPLICAS[:3])
    if policy == "round_robin":
        assert sorted(seen.values()) == [13, 13, 14]


def test_queued_prefill_pushes_new_work_elsewhere() -> None:
    router = make_router(load_factor=100.0)
    text = chat_text(system_prompt(3), "a")
    home = router.route(router.request_from_text(text), idle()).replica
    # The home replica now has a large prefill backlog: a cold prompt goes elsewhere even though
    # its rendezvous owner may be that same replica.
    views = [ReplicaView(name=n, pending_prefill_tokens=50_000 if n == home else 0)
             for n in REPLICAS]
    for i in range(20):
        d = router.route(router.request_from_text(chat_text(system_prompt(200 + i), "b")), views)
        assert d.replica != home


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        build_policy("nope")


def test_requests_in_flight_count_as_queue() -> None:
    router = make_router(load_factor=100.0, inflight_tokens=256.0, load_weight=0.5)
    text = chat_text(system_prompt(4), "a")
    owner = router.route(router.request_from_text(text), idle()).replica
    # Same queued prefill everywhere, but the owner is busy decoding 40 sequences: a new cold
    # prompt goes elsewhere, since every engine step there is longer.
    views = [ReplicaView(name=n, inflight=40 if n == owner else 0) for n in REPLICAS]
    for i in range(10):
        d = router.route(router.request_from_text(chat_text(system_prompt(300 + i), "b")), views)
        assert d.replica != owner


def second_turn(router: Router, holder_queued: float,
                kv_usage: float | None) -> tuple[str, Decision]:
    """The replica holding a 5,000-token context after its first turn, and the decision for
    the second turn while that holder has `holder_queued` tokens of prefill queued, every
    other replica one token (so the fleet is busy: the queue weighs load_weight), and every
    engine reports `kv_usage`."""
    context = system_prompt(7, 20_000)
    holder = router.route(router.request_from_text(chat_text(context, "first")), idle()).replica
    views = [ReplicaView(name=n, pending_prefill_tokens=holder_queued if n == holder else 1,
                         kv_usage=kv_usage) for n in REPLICAS]
    return holder, router.route(router.request_from_text(chat_text(context, "second")), views)


@pytest.mark.parametrize(("kv_usage", "pressure", "stays"), [
    (None, 0.8, False),  # no engine reports its KV usage: the queue weighs load_weight
    (0.5, 0.8, False),
    (0.85, 0.8, True),
    (0.85, None, False),  # the rule off
])
def test_a_fleet_near_its_kv_capacity_weighs_the_queue_less_than_a_miss(
        kv_usage: float | None, pressure: float | None, stays: bool) -> None:
    # The holder has 16,000 tokens of prefill queued. At load_weight (0.5) its queue prices
    # 8,000 tokens against the 5,000 a miss costs elsewhere, past the slack: the turn leaves
    # its context. At kv_pressure_load_weight (0.25) it prices 4,000 and the turn stays where
    # its context is cached.
    holder, d = second_turn(make_router(kv_pressure_usage=pressure, time_cap=None), 16_000,
                            kv_usage)
    assert (d.replica == holder) is stays
    assert d.matched_blocks > 0 if stays else d.matched_blocks == 0


def test_kv_pressure_never_weighs_the_queue_more_than_the_settings_do() -> None:
    # The holder's queue now 32,000 tokens: at the rule's 0.25 it prices 8,000 against the
    # 5,000 a miss costs, so the turn would leave. An operator who weighs the queue at 0.1
    # everywhere keeps it (3,200) under KV pressure too: the rule lowers the weight, it never
    # raises it.
    router = make_router(load_weight=0.1, idle_load_weight=0.1, time_cap=None)
    holder, d = second_turn(router, 32_000, 0.85)
    assert d.replica == holder and d.matched_blocks > 0
    # At the defaults' 0.5, the same 0.85 of KV used brings it to 0.25, and the turn leaves.
    holder, d = second_turn(make_router(time_cap=None), 32_000, 0.85)
    assert d.replica != holder and d.matched_blocks == 0


def test_cold_prompts_of_uneven_length_balance_prefill() -> None:
    router = make_router()
    sent: Counter[str] = Counter()
    for i in range(64):
        # Lengths from 500 to 8,000 characters: rendezvous alone balances counts, not tokens.
        req = router.request_from_text(chat_text(system_prompt(400 + i, 500 + (i * 997) % 7500),
                                                 "q"))
        d = router.route(req, idle())
        assert d.reason == REASON_COLD
        sent[d.replica] += int(d.uncached_tokens)
    mean = sum(sent.values()) / len(REPLICAS)
    assert max(sent.values()) <= 1.15 * mean


def test_load_allowance_lets_a_home_hold_more_than_the_bound() -> None:
    router = make_router(load_factor=1.0, load_allowance=3, load_weight=0.0,
                         inflight_tokens=0.0)
    load = router.load
    sys_prompt = system_prompt(8)
    served = Counter()
    for u in range(8):
        views = [load.view(n) for n in REPLICAS]
        d = router.route(router.request_from_text(chat_text(sys_prompt, f"u{u}")), views)
        assert load.inflight.get(d.replica, 0) + 1 <= load_bound(views, 1.0) + 3
        router.dispatched(d)
        served[d.replica] += 1
    # Without the allowance the home would hold at most ceil(8 / 4) = 2 of them.
    assert max(served.values()) >= 4


def test_step_timing_from_chunk_arrivals() -> None:
    steps = StepTimer()
    # Two streams: each 40 ms step ends in two chunks a fraction of a millisecond apart.
    for step in range(6):
        t = 1.0 + 0.040 * step
        steps.chunk("r0", t)
        steps.chunk("r0", t + 0.0004)
    assert steps.step_s("r0") == pytest.approx(0.040)
    last = 1.0 + 0.040 * 5
    assert steps.remaining("r0", last + 0.010) == pytest.approx(0.030)
    assert steps.remaining("r0", last + 0.050) == 0.0  # overdue: no estimate of the rest
    # A 1-second outlier (a long prefill step) does not move the estimate.
    steps.chunk("r0", last + 1.0)
    assert steps.step_s("r0") == pytest.approx(0.040)


def test_idle_replica_has_no_step_to_wait_for() -> None:
    load = LoadTracker(prefill_tokens_per_s=10_000.0)
    load.dispatched("r0", 10.0)
    load.chunk("r0", 1.00)
    load.chunk("r0", 1.05)
    assert load.view("r0", 1.06).step_wait_tokens == pytest.approx(400.0)  # 40 ms at 10k/s
    load.finished("r0", 10.0, True)
    assert load.view("r0", 1.06).step_wait_tokens == 0.0
    # After idling, the first chunk starts a new run: the idle time is not a step.
    load.dispatched("r0", 10.0)
    load.chunk("r0", 30.0)
    assert load.steps.step_s("r0") == pytest.approx(0.05)


def replay_steps(load: LoadTracker, steps: list[tuple[float, str]]) -> float:
    """Feed a replica's chunks: `steps` are (length, event) with event "" (decode), "send"
    (a request is sent just after the step began) or "first" (the step ends with the first
    token of the request sent last). A long stream keeps the replica busy throughout."""
    load.dispatched("r0", 0.0)
    t = 0.0
    sent_at = 0.0
    load.chunk("r0", t)
    for length, event in steps:
        if event == "send":
            sent_at = t + 0.001
            load.dispatched("r0", 1000.0)
        t += length
        load.chunk("r0", t)
        if event == "first":
            load.first_token("r0", 1000.0, t, dispatched_at=sent_at)
    return t


def test_prefill_rate_is_learned_from_steps_that_carry_a_prefill() -> None:
    # Decode steps take 50 ms; a step that also prefills 1,000 tokens takes 100 ms: 20,000
    # tokens/s. Half the requests wait two decode steps before the engine admits them, as a
    # real engine's input processing makes them.
    load = LoadTracker()
    cycle_now = [(0.05, ""), (0.05, "send"), (0.10, "first")]
    cycle_late = [(0.05, ""), (0.05, "send"), (0.05, ""), (0.05, ""), (0.10, "first")]
    replay_steps(load, (cycle_now + cycle_late) * 15)
    assert load.steps.learning
    assert load.steps.rate == pytest.approx(20_000.0, rel=0.02)
    assert load.steps.decode_s(1) == pytest.approx(0.050)


def test_a_first_token_trailing_its_step_still_teaches_the_rate() -> None:
    # On a machine whose cores are busy, one step's chunks reach the gateway milliseconds
    # apart: the first token of the request a 100 ms step prefilled trails the long stream's
    # chunk of that step by 4 ms, more than SAME_STEP_S but a small part of a 50 ms decode step.
    load = LoadTracker()
    load.dispatched("r0", 0.0)
    t = 0.0
    load.chunk("r0", t)
    for _ in range(30):
        t += 0.05
        load.chunk("r0", t)
        sent_at = t + 0.001
        load.dispatched("r0", 1000.0)
        t += 0.05
        load.chunk("r0", t)
        t += 0.10
        load.chunk("r0", t)
        load.chunk("r0", t + 0.004)
        load.first_token("r0", 1000.0, t + 0.004, dispatched_at=sent_at)
    assert load.steps.rate == pytest.approx(20_000.0, rel=0.02)
    assert load.steps.decode_s(1) == pytest.approx(0.050)


def test_a_request_sent_during_a_long_step_is_credited_to_the_next() -> None:
    # A request sent just after a long step began (another prompt's 200 ms chunk) waits for
    # that step to end, and the next step carries its whole prefill: it teaches the rate, though
    # it was sent earlier than one typical step before its prefill step began.
    load = LoadTracker()
    replay_steps(load, [(0.05, ""), (0.05, ""), (0.20, "send"), (0.10, "first")] * 25)
    assert load.steps.rate == pytest.approx(20_000.0, rel=0.02)


def decode_step_wait(decode_step_wait: bool) -> float:
    """The wait priced on a replica 10 ms into a decode-only step, after steps that alternate
    40 ms of decode alone with 100 ms that also prefill a request."""
    load = LoadTracker(prefill_tokens_per_s=10_000.0, decode_step_wait=decode_step_wait)
    t = replay_steps(load, [(0.04, ""), (0.04, "send"), (0.10, "first")] * 20 + [(0.04, "")])
    assert load.pending_prefill["r0"] == 0.0  # nothing awaits a first token there
    return load.view("r0", t + 0.010).step_wait_tokens


def test_a_step_with_no_prefill_pending_is_timed_as_decode_alone() -> None:
    # The typical step averages in the 100 ms steps; the step in flight decodes only, so its
    # rest is 30 ms (300 tokens at 10,000 a second), as the decode-only line says.
    assert decode_step_wait(True) == pytest.approx(300.0, rel=0.05)
    assert decode_step_wait(False) > 400.0


def test_a_step_with_prefill_pending_is_timed_as_a_typical_step() -> None:
    # With decode_step_wait on, a prefill awaiting its first token keeps the typical step.
    load = LoadTracker(prefill_tokens_per_s=10_000.0, decode_step_wait=True)
    t = replay_steps(load, [(0.04, ""), (0.04, "send"), (0.10, "first")] * 20 + [(0.04, "")])
    load.dispatched("r0", 1000.0)  # awaiting its first token: the step may carry it
    typical = load.steps.step_s("r0")
    assert typical > 0.05
    assert load.view("r0", t + 0.010).step_wait_tokens == pytest.approx(
        (typical - 0.010) * 10_000.0)


def test_chunked_prefill_teaches_nothing() -> None:
    # Each prompt is prefilled in two 100 ms chunks; only the second ends in a first token.
    # Counting that step alone would claim twice the true rate: the step before it was no
    # decode step, and the request was sent two steps before, so it is not counted.
    load = LoadTracker()
    t = replay_steps(load, [(0.05, ""), (0.05, "send"), (0.10, ""), (0.10, "first")] * 30)
    assert load.steps.rate == 0.0  # unknown: no wait is priced
    assert load.view("r0", t + 0.01).step_wait_tokens == 0.0


def test_equal_replicas_prefer_the_one_whose_step_ends_soonest() -> None:
    router = make_router(load_factor=100.0)
    text = chat_text(system_prompt(5), "q")
    for name in REPLICAS:  # every replica holds the prompt
        router.record(name, router.request_from_text(text).hashes)
    # 100 ms steps of a CPU engine at 9,000 prefill tokens/s, say: a request sent to r2 now
    # waits 150 ms before the engine even schedules it, worth 1,350 prompt tokens.
    wait = {"r0": 1080.0, "r1": 36.0, "r2": 1350.0, "r3": 810.0}
    views = [ReplicaView(name=n, inflight=3, step_wait_tokens=wait[n]) for n in REPLICAS]
    for u in range(5):
        d = router.route(router.request_from_text(chat_text(system_prompt(5), f"user {u}")), views)
        assert d.replica == "r1"
    # Without the wait the choice falls to balancing and spreads.
    plain = [ReplicaView(name=n, inflight=3) for n in REPLICAS]
    chosen = {router.route(router.request_from_text(chat_text(system_prompt(5), f"user {u}")),
                           plain).replica for u in range(8)}
    assert len(chosen) > 1


def test_a_removed_replica_keeps_no_prefix_and_its_load_goes_when_forgotten() -> None:
    router = make_router()
    req = router.request_from_text(chat_text(system_prompt(7), "q"))
    home = router.route(req, idle())
    assert router.matched_blocks(home.replica, req.hashes) > 0
    router.dispatched(home)
    assert home.replica in router.policy._recent
    router.remove_replica(home.replica)
    assert router.matched_blocks(home.replica, req.hashes) == 0
    assert home.replica not in router.policy._recent  # the policy forgot it too
    router.record(home.replica, req.hashes)  # a late record of it is a no-op
    assert home.replica not in router.indexes
    # Its request in flight is still counted until it ends, then the counters go.
    assert router.load.inflight[home.replica] == 1
    router.finished(home, saw_first_token=False)
    router.forget_load(home.replica)
    assert home.replica not in router.load.inflight
    assert home.replica not in router.load.pending_prefill
    # The same prompt now goes to a replica that is left, and is a cold miss there.
    others = [n for n in REPLICAS if n != home.replica]
    again = router.route(router.request_from_text(chat_text(system_prompt(7), "q2")),
                         idle(others))
    assert again.replica in others and again.reason == REASON_COLD


# Shared routing state: what other gateways decided, applied by pure methods ---------------


def test_remote_inserts_make_a_second_router_follow_the_first() -> None:
    a, b = make_router(), make_router()
    recorded: list[tuple[str, list[int], float]] = []
    a.on_record = lambda replica, hashes, cost, held, output: recorded.append(
        (replica, list(hashes), cost))
    text = chat_text(system_prompt(7), "q")
    # A warm prefix on a non-home replica: b, which never saw it, would route it elsewhere.
    home = a.route(a.request_from_text(text), idle()).replica
    other = next(n for n in REPLICAS if n != home)
    a.route(a.request_from_text(chat_text(system_prompt(7), "r")),
            [ReplicaView(name=other)])
    assert [r for r, _, _ in recorded] == [home, other]
    assert recorded[0][2] > 0  # the cold prompt's prefill
    assert b.matched_blocks(other, recorded[1][1]) == 0
    applied = b.apply_remote_inserts([*recorded, ("gone", recorded[0][1], 0.0),
                                      (home, [], 0.0)])
    assert applied == 2  # the unknown replica and the empty chain are skipped
    # b now holds what a recorded, on both replicas, without telling its own listener.
    seen: list[str] = []
    b.on_record = lambda replica, hashes, cost, held, output: seen.append(replica)
    assert b.matched_blocks(other, recorded[1][1]) == len(recorded[1][1])
    d = b.route(b.request_from_text(chat_text(system_prompt(7), "s")),
                [ReplicaView(name=other), ReplicaView(name="r9")])
    assert d.replica == other and d.reason == REASON_AFFINITY
    assert seen == [other]  # b's own decision is told; the applied inserts were not


def test_remote_load_adds_to_the_view_but_not_to_own_counts() -> None:
    router = make_router(load_factor=100.0)
    router.load.dispatched("r0", 100.0)
    router.apply_remote_load(sum_loads([{"r0": [3, 500.0, 500.0], "r1": [2, 0.0, 0.0],
                                         "r2": [0, 0.0, 0.0]}]))
    v0, v1, v2 = (router.load.view(n) for n in ("r0", "r1", "r2"))
    assert (v0.inflight, v0.pending_prefill_tokens) == (4, 600.0)
    assert (v1.inflight, v1.pending_prefill_tokens) == (2, 0.0)
    assert (v2.inflight, v2.pending_prefill_tokens) == (0, 0.0)
    # What this gateway itself must finish (drain waits on it) is its own count only.
    assert router.load.inflight == {"r0": 1}
    # A new report replaces the previous one entirely.
    router.apply_remote_load(sum_loads([{"r1": [1, 10.0, 10.0]}]))
    assert router.load.view("r0").inflight == 1
    assert router.load.view("r1").pending_prefill_tokens == 10.0


def test_remote_load_pushes_new_work_elsewhere() -> None:
    router = make_router(load_factor=100.0)
    text = chat_text(system_prompt(8), "a")
    home = router.route(router.request_from_text(text), idle()).replica
    # Other gateways have queued a large prefill on this router's home replica.
    router.apply_remote_load(sum_loads([{home: [1, 50_000.0, 50_000.0]}]))
    for i in range(10):
        req = router.request_from_text(chat_text(system_prompt(400 + i), "b"))
        views = [router.load.view(n) for n in REPLICAS]
        assert router.route(req, views).replica != home


def test_pending_prefill_drains_while_the_oldest_request_prefills() -> None:
    # A 40k-token prompt, then a 2k one, on a replica decoding other streams: each 0.5 s step
    # (decode-only steps there take 40 ms) computes about 0.46 s x 10k tokens of the oldest.
    load = LoadTracker(prefill_tokens_per_s=10_000.0)
    load.steps._decode.observe(1, 0.040)
    load.dispatched("r0", 40_000.0)
    load.dispatched("r0", 2_000.0)
    load.chunk("r0", 0.0)
    assert load.view("r0").prefill_left_tokens == 42_000.0
    load.chunk("r0", 0.5)
    assert load.view("r0").prefill_left_tokens == pytest.approx(42_000.0 - 4_600.0)
    for i in range(2, 20):
        load.chunk("r0", 0.5 * i)
    # Never all of it before its first token: the router may have believed it cached more
    # than the engine held.
    assert load.view("r0").prefill_left_tokens == pytest.approx(2_000.0 + 4_000.0)
    assert load.view("r0").pending_prefill_tokens == 42_000.0  # the raw count is untouched
    load.first_token("r0", 40_000.0)
    assert load.view("r0").prefill_left_tokens == 2_000.0  # the next one starts from scratch


def test_other_gateways_see_the_drained_prefill_this_one_routes_on() -> None:
    # Gateway A has a 40k-token prompt nearly through its prefill on r0; gateway B, sharing
    # A's load, must see what A sees of it, not the whole prompt (counted whole, B spilled
    # away from replicas A had busy far more often than one gateway would).
    a = LoadTracker(prefill_tokens_per_s=10_000.0)
    a.steps._decode.observe(1, 0.040)
    a.dispatched("r0", 40_000.0)
    for i in range(8):
        a.chunk("r0", 0.5 * i)
    drained = a.view("r0").prefill_left_tokens
    assert drained is not None and drained < 40_000.0 - 30_000.0
    b = LoadTracker(prefill_tokens_per_s=10_000.0)
    b.set_remote(sum_loads([a.own_load()]))
    seen = b.view("r0")
    assert seen.pending_prefill_tokens == 40_000.0  # the raw count travels too
    # Within the 16 tokens the published figure is rounded to.
    assert drained <= seen.prefill_left_tokens < drained + 16.0
    # An entry without the drained figure (an older gateway's) counts its prefill whole.
    b.set_remote(sum_loads([{"r0": [1, 40_000.0]}]))
    assert b.view("r0").prefill_left_tokens == 40_000.0


def test_no_drain_while_another_gateways_older_request_is_the_one_prefilling() -> None:
    # Gateway B sent a 20k-token prompt to r0 at t=1.0, gateway A a 10k one at t=2.0. The
    # engine prefills in arrival order: B's first. Credited to A's as well, each 0.5 s step
    # counted twice (three gateways on the mixed fleet's tenants near saturation: queues
    # looked about a tenth drained that were not, 8% slower than one gateway).
    a, b = (LoadTracker(prefill_tokens_per_s=10_000.0) for _ in range(2))
    for load in (a, b):
        load.steps._decode.observe(1, 0.040)
    b.dispatched("r0", 20_000.0, sent_at=1.0)
    a.dispatched("r0", 10_000.0, sent_at=2.0)
    a.set_remote(sum_loads([b.own_load()]))
    assert a.remote["r0"][4] == 1.0  # when B's oldest request there was sent
    for i in range(4):
        a.chunk("r0", 0.5 * i)
    assert a.view("r0").prefill_left_tokens == 10_000.0 + 20_000.0
    b.first_token("r0", 20_000.0, 2.0, dispatched_at=1.0)  # B's done: A's is the oldest now
    a.set_remote(sum_loads([b.own_load()]))
    assert a.remote["r0"][4] == math.inf
    a.chunk("r0", 2.0)
    assert a.view("r0").prefill_left_tokens == pytest.approx(10_000.0 - 4_600.0)
    # A's own request sent first (or an older gateway that does not say when): A credits.
    c = LoadTracker(prefill_tokens_per_s=10_000.0)
    c.steps._decode.observe(1, 0.040)
    c.dispatched("r0", 10_000.0, sent_at=0.5)
    c.set_remote(sum_loads([b.own_load(), {"r1": [1, 500.0, 500.0]}]))
    c.chunk("r0", 0.0)
    c.chunk("r0", 0.5)
    assert c.view("r0").prefill_left_tokens == pytest.approx(10_000.0 - 4_600.0)


def test_no_drain_without_a_rate_or_while_only_decoding() -> None:
    load = LoadTracker()  # no rate learned yet: nothing is presumed done
    load.dispatched("r0", 8_000.0)
    for i in range(10):
        load.chunk("r0", 0.5 * i)
    assert load.view("r0").prefill_left_tokens is None
    fixed = LoadTracker(prefill_tokens_per_s=10_000.0)
    fixed.steps._decode.observe(2, 0.040)
    fixed.dispatched("r0", 8_000.0)
    fixed.dispatched("r0", 8_000.0)
    for i in range(10):  # decode-only steps: the engine is not prefilling (e.g. KV full)
        fixed.chunk("r0", 0.040 * i)
    assert fixed.view("r0").prefill_left_tokens == 16_000.0


@pytest.mark.parametrize("drain", [True, False])
def test_prefix_affinity_prices_the_drained_queue_when_asked(drain: bool) -> None:
    router = make_router(load_factor=100.0, drain_pending=drain)
    # r0 has more prefill pending, but most of it is a long prompt nearly done.
    views = [ReplicaView(name="r0", pending_prefill_tokens=30_000, prefill_left_tokens=1_000),
             ReplicaView(name="r1", pending_prefill_tokens=8_000, prefill_left_tokens=8_000)]
    picks = {router.route(router.request_from_text(chat_text(system_prompt(500 + i), "q")),
                          views).replica for i in range(10)}
    assert picks == ({"r0"} if drain else {"r1"})


def feed_replica(load: LoadTracker, name: str, cycles: int, decode_s: float,
                 prefill_s: float, tokens: float = 1000.0, start: float = 0.0,
                 per_seq_s: float = 0.0, finish: bool = False) -> None:
    """A fake clock for one replica: a long stream keeps it decoding in steps of `decode_s`
    plus `per_seq_s` per request in flight; every third step also prefills a request of
    `tokens` sent while the step before ran, and lasts `prefill_s` more. Each such request
    keeps decoding (the batch grows by one a cycle), or with `finish` ends at its first
    token."""
    load.dispatched(name, 0.0)
    t = start
    load.chunk(name, t)
    for _ in range(cycles):
        t += decode_s + per_seq_s * load.batch(name)
        load.chunk(name, t)
        sent_at = t + 0.001
        load.dispatched(name, tokens)
        t += decode_s + per_seq_s * load.batch(name)
        load.chunk(name, t)
        t += decode_s + per_seq_s * load.batch(name) + prefill_s
        load.chunk(name, t)
        load.first_token(name, tokens, t, dispatched_at=sent_at)
        if finish:
            load.finished(name, tokens, saw_first_token=True)


def test_a_configured_prefill_rate_is_not_shared_as_a_learned_one() -> None:
    from routing.steps import POOL_RATE_KEY

    learned, configured = LoadTracker(), LoadTracker(prefill_tokens_per_s=9_000.0)
    for load in (learned, configured):
        feed_replica(load, "r0", 12, 0.05, 0.05)
    # 11 samples of 1,000 tokens in 50 ms: too few to use alone, shared as what they say.
    tokens, seconds, samples = learned.steps.own_rates()[POOL_RATE_KEY][:3]
    assert (tokens / seconds, samples) == (pytest.approx(20_000.0, rel=0.02), 11)
    assert learned.steps.rate == 0.0
    assert POOL_RATE_KEY not in configured.steps.own_rates()
    assert "r0" in configured.steps.own_rates()


def test_each_replica_learns_its_own_prefill_rate_and_speed() -> None:
    # r0 and r1 decode in 50 ms and prefill 1,000 tokens in 50 ms more (20,000 tokens/s); r2
    # is three times slower at everything, r3 1.2 times. The pool's decode line mixes them, so
    # each replica must judge its steps by its own decode steps.
    load = LoadTracker()
    feed_replica(load, "r0", 40, 0.05, 0.05)
    feed_replica(load, "r1", 40, 0.05, 0.05)
    feed_replica(load, "r2", 40, 0.15, 0.15)
    feed_replica(load, "r3", 40, 0.06, 0.06)
    assert load.steps.replica_rate("r0") == pytest.approx(20_000.0, rel=0.02)
    assert load.steps.replica_rate("r2") == pytest.approx(20_000.0 / 3, rel=0.02)
    assert load.steps.replica_rate("r3") == pytest.approx(20_000.0 / 1.2, rel=0.02)
    assert load.steps.replica_rates().keys() == {"r0", "r1", "r2", "r3"}
    # Against the median replica's rate; a difference within SPEED_TOLERANCE is scatter.
    assert load.view("r2").speed == pytest.approx(1 / 3 * 20_000 / (
        (load.steps.replica_rate("r0") + load.steps.replica_rate("r3")) / 2), rel=0.03)
    assert load.view("r0").speed == load.view("r1").speed == load.view("r3").speed == 1.0


def test_a_replica_slower_only_at_prefill_is_scatter_not_a_slower_replica() -> None:
    # Equal replicas' learned prefill rates stray (long prompts prefilled in chunks); their
    # decode steps do not. r2's prefill looks 2.4 times as slow, but it decodes as fast as the
    # others: its speed stays 1. r3 is slower at prefill and also decodes 1.6 times slower,
    # as a slower accelerator does: its speed departs.
    load = LoadTracker()
    for name in ("r0", "r1"):
        feed_replica(load, name, 40, 0.05, 0.05)
    feed_replica(load, "r2", 40, 0.05, 0.12)
    feed_replica(load, "r3", 40, 0.08, 0.15)
    rates = load.steps.replica_rates()
    assert rates["r2"] == pytest.approx(1000 / 0.12, rel=0.02)
    median = (rates["r0"] + rates["r2"]) / 2
    assert rates["r2"] / median < 1 / SPEED_TOLERANCE  # past the tolerance, yet:
    assert load.view("r2").speed == 1.0
    assert load.view("r3").speed == pytest.approx(rates["r3"] / median, rel=0.01)
    assert load.view("r3").speed < 0.5


def test_a_slow_replica_kept_nearly_idle_stays_slow_as_the_others_batches_grow() -> None:
    # r0-r2 fill up: every request they prefill keeps decoding, and a decode step lasts 20 ms
    # plus 1 ms per sequence (21 to 80 ms over 60 requests). r3 is four times slower at
    # prefill and decodes in 45 ms at a batch of one or two, twice the others' there: it is
    # slower, and its speed says so. Its line, with no slope of its own, takes the pool's;
    # drawn flat to the pool's mean batch, about 30, it looked as fast as theirs, and its
    # speed went back to 1 as the load rose.
    load = LoadTracker()
    for name in ("r0", "r1", "r2"):  # 1,000 tokens at 20,000/s
        feed_replica(load, name, 60, 0.02, 0.05, per_seq_s=0.001)
    feed_replica(load, "r3", 6, 0.045, 0.2, finish=True)
    assert load.steps.replica_rate("r3") == pytest.approx(5_000.0, rel=0.02)
    assert load.view("r3").speed == pytest.approx(0.25, rel=0.05)
    assert load.view("r0").speed == 1.0


def test_a_step_that_ended_another_gateways_prefill_teaches_neither_decode_nor_rate() -> None:
    # Another gateway (or worker) has requests on r1 and r2, prefill queued on both. On r1
    # each prefill step also ended one of its prefills (its count of first tokens there moves
    # as the step ends), whose tokens this gateway does not know: neither a decode step nor a
    # measure of this gateway's prefill. On r2 its queued prompt only waited (no first token
    # of its ended there): the steps teach as if this gateway were alone. Taken for decode
    # steps, the first kind raised three gateways' decode line several times over, and every
    # rate measured against it came out too fast.
    def feed(load: LoadTracker, name: str, others_end_prefills: bool) -> None:
        load.dispatched(name, 0.0)
        t, theirs = 0.0, 0
        load.chunk(name, t)
        for _ in range(40):
            for step_s in (0.05, 0.05):
                t += step_s
                load.chunk(name, t)
            sent_at = t - 0.01
            load.dispatched(name, 1000.0)
            t += 0.1  # 50 ms of decode and 50 ms of this gateway's prefill (20,000 tokens/s)
            load.chunk(name, t)
            load.first_token(name, 1000.0, t, dispatched_at=sent_at)
            if others_end_prefills:  # and, they say a few milliseconds later, one of theirs
                theirs += 1
            load.set_remote({name: (2, 3000.0, 3000.0, theirs, -1.0)})

    alone, shared = LoadTracker(), LoadTracker()
    alone.set_remote({"r2": (2, 3000.0, 3000.0, 0, -1.0)})
    feed(alone, "r2", others_end_prefills=False)
    shared.set_remote({"r1": (2, 3000.0, 3000.0, 0, -1.0)})
    feed(shared, "r1", others_end_prefills=True)
    assert alone.steps.decode_s(3) == pytest.approx(0.05, rel=0.02)
    assert alone.steps.rate == pytest.approx(20_000.0, rel=0.02)
    assert alone.steps.replica_rate("r2") == pytest.approx(20_000.0, rel=0.02)
    # r1's decode steps still teach it; its prefill steps teach nothing.
    assert shared.steps.decode_s(3) == pytest.approx(0.05, rel=0.02)
    assert shared.steps.rate == 0.0
    assert shared.steps.replica_rate("r1") is None


def test_with_other_gateways_only_decoding_a_replica_still_learns_its_speed() -> None:
    # Other gateways' requests on every replica are only decoding: no prefill of theirs ends
    # in these steps, so each replica's own rate learns, and with it the speed that tells the
    # slow replica r2, as does the pool's rate.
    load = LoadTracker()
    load.set_remote(sum_loads([{name: [2, 0.0, 0.0] for name in ("r0", "r1", "r2")}]))
    feed_replica(load, "r0", 40, 0.05, 0.05)
    feed_replica(load, "r1", 40, 0.05, 0.05)
    feed_replica(load, "r2", 40, 0.15, 0.15)
    assert load.steps.rate > 0.0
    assert load.steps.replica_rate("r0") == pytest.approx(20_000.0, rel=0.02)
    assert load.view("r2").speed == pytest.approx(1 / 3, rel=0.02)
    assert load.view("r0").speed == 1.0


def test_speed_is_one_until_learned_or_with_a_configured_rate() -> None:
    load = LoadTracker()
    feed_replica(load, "r0", 5, 0.05, 0.05)  # 4 samples: too few yet
    assert load.steps.replica_rate("r0") is None
    assert load.view("r0").speed == 1.0
    fixed = LoadTracker(prefill_tokens_per_s=9000.0)
    feed_replica(fixed, "r0", 40, 0.05, 0.05)
    feed_replica(fixed, "r1", 40, 0.15, 0.15)
    assert fixed.view("r1").speed == fixed.view("r0").speed == 1.0


def test_samples_from_steps_that_left_nothing_queued_teach_a_speed_sooner() -> None:
    # Each step here that ends a prefill leaves nothing else of this gateway's awaiting a
    # first token on r0: no chunk of another prompt can have hidden in it, and five such
    # samples give the rate. On r1 a long prompt stays queued throughout: its steps may hold
    # chunks of it, and the rate needs ten.
    load = LoadTracker()
    feed_replica(load, "r0", 6, 0.05, 0.05)  # 5 samples
    load.dispatched("r1", 50_000.0)
    feed_replica(load, "r1", 6, 0.05, 0.05)
    assert load.steps.replica_rate("r0") == pytest.approx(20_000.0, rel=0.02)
    assert load.steps.replica_rate("r1") is None
    feed_replica(load, "r1", 6, 0.05, 0.05, start=10.0)
    assert load.steps.replica_rate("r1") == pytest.approx(20_000.0, rel=0.02)


def lone_prefill(load: LoadTracker, name: str, seconds: float, tokens: float = 2000.0,
                 start: float = 0.0, cold: bool = True) -> None:
    """One request of `tokens` sent to `name` at `start`; its first token, the replica's
    first chunk since, `seconds` later."""
    load.dispatched(name, tokens)
    load.chunk(name, start + seconds)
    load.first_token(name, tokens, start + seconds, dispatched_at=start, cold=cold)


def test_a_lone_cold_prompt_on_an_idle_replica_teaches_its_speed_at_once() -> None:
    # r2 is four times slower. Each replica's first request is a cold prompt sent while
    # nothing was in flight there: its time to first token is its prefill, with nothing
    # else in the steps, and one such request gives the replica's rate.
    load = LoadTracker()
    for name, seconds in (("r0", 0.1), ("r1", 0.1), ("r2", 0.4)):
        lone_prefill(load, name, seconds)
    assert load.steps.replica_rate("r0") == pytest.approx(20_000.0)
    assert load.steps.replica_rate("r2") == pytest.approx(5_000.0)
    assert load.view("r2").speed == pytest.approx(0.25)
    assert load.view("r0").speed == 1.0


@pytest.mark.parametrize("case", ["held", "short", "quick", "busy", "joined"])
def test_a_first_token_teaches_no_speed_unless_the_prefill_ran_alone_on_an_idle_replica(
        case: str) -> None:
    # Each departs from the lone cold prompt above in one way: the router believed the
    # replica held some of the prompt (reading cached KV takes time too, and the first
    # token does not say how much); the prompt is short (the step's fixed cost and the
    # round trip would be most of its time); it took 5 ms (timing jitter on a busy host can
    # be as much); another request was in flight when it was
    # sent (its response not streamed, and over before the first token); another joined it
    # before its first token. None teaches r0 its rate.
    load = LoadTracker()
    if case == "busy":  # a request unstreamed there, done before the first token
        load.dispatched("r0", 500.0)
        load.dispatched("r0", 2000.0)
        load.finished("r0", 500.0, saw_first_token=False)
        load.chunk("r0", 0.1)
        load.first_token("r0", 2000.0, 0.1, dispatched_at=0.0, cold=True)
    elif case == "joined":
        load.dispatched("r0", 2000.0)
        load.dispatched("r0", 2000.0)
        load.chunk("r0", 0.1)
        load.first_token("r0", 2000.0, 0.1, dispatched_at=0.0, cold=True)
    else:
        lone_prefill(load, "r0", 0.005 if case == "quick" else 0.1,
                     tokens=100.0 if case == "short" else 2000.0, cold=case != "held")
    assert load.steps.replica_rate("r0") is None


def test_the_router_says_whether_the_routed_replica_held_any_of_the_prompt() -> None:
    # Through the router: r1 first serves prompt A beside another request (no lone sample),
    # then A with as much again after it, alone on an idle r1, which holds its first half:
    # no sample either. Prompt B, held nowhere, alone on an idle r0 teaches r0 its rate.
    router = make_router(replicas=["r0", "r1"])
    a, b = system_prompt(1, chars=20_000), system_prompt(2, chars=20_000)

    def serve(text: str, name: str, start: float, beside: bool = False) -> None:
        decision = router.route(router.request_from_text(text), idle([name]))
        assert decision.replica == name
        other = router.route(router.request_from_text("x"), idle([name])) if beside else None
        router.dispatched(decision, start)
        if other is not None:
            router.dispatched(other, start)
        router.chunk(name, start + 0.1)
        router.first_token(decision, start + 0.1, start)
        for d in (decision, other):
            if d is not None:
                router.finished(d, saw_first_token=d is decision)

    serve(a, "r1", 0.0, beside=True)
    serve(a + system_prompt(3, chars=20_000), "r1", 1.0)
    serve(b, "r0", 2.0)
    assert router.load.steps.replica_rate("r1") is None
    assert router.load.steps.replica_rate("r0") is not None


def test_on_a_mixed_fleet_a_replica_not_yet_learned_is_priced_as_the_fastest() -> None:
    # r1 is four times slower than r0; r2 has not served yet. Priced at 1, between the two,
    # a fast r2 could lose every request to r0 (which holds the prefixes) and to r1, and
    # never show its speed; priced as the fastest it is sent work, and a slow r2 serves one
    # request before it is known.
    load = LoadTracker()
    feed_replica(load, "r0", 40, 0.05, 0.05)
    feed_replica(load, "r1", 40, 0.2, 0.2)
    assert load.view("r1").speed < load.view("r0").speed
    assert load.view("r2").speed == load.view("r0").speed > SPEED_TOLERANCE
    # Equal replicas: one not yet learned is priced at 1, as they are.
    equal = LoadTracker()
    for name in ("r0", "r1"):
        feed_replica(equal, name, 40, 0.05, 0.05)
    assert equal.view("r2").speed == equal.view("r0").speed == 1.0


def test_a_slow_replica_is_charged_its_queue_at_its_own_speed() -> None:
    # The same queue on every replica; r3 is three times slower, so its queue lasts three
    # times longer there: cold prompts avoid it, and with the setting off they do not.
    def spread(replica_speed: bool) -> Counter[str]:
        router = make_router(load_factor=100.0, replica_speed=replica_speed, balance_horizon=0)
        views = [ReplicaView(name=n, inflight=4, pending_prefill_tokens=4000.0,
                             speed=1 / 3 if n == "r3" else 1.0) for n in REPLICAS]
        return Counter(router.route(router.request_from_text(
            chat_text(system_prompt(500 + i), "q")), views).replica for i in range(60))

    assert spread(True)["r3"] == 0
    assert spread(False)["r3"] > 5


def feed_standing_queue(load: LoadTracker, name: str, requests: int, seconds_each: float,
                        tokens: float = 4000.0) -> None:
    """A replica with a standing queue: every request is sent at time 0 and they get their
    first tokens one after another, `seconds_each` apart, with no engine step ever timed (no
    step carries a prefill sent just before it, so no own rate is learned)."""
    for _ in range(requests):
        load.dispatched(name, tokens)
    for i in range(requests):
        load.first_token(name, tokens, now=seconds_each * (i + 1), dispatched_at=0.0)


def test_under_a_standing_queue_a_replica_gets_a_busy_speed_before_its_own_rate() -> None:
    # r3 completes 4,000-token prefills three times slower than the others; none of them
    # ever shows a step from which its own rate could be learned.
    load = LoadTracker()
    for name in REPLICAS:
        feed_standing_queue(load, name, 30, 0.6 if name == "r3" else 0.2)
    assert load.steps.replica_rate("r3") is None
    assert load.view("r3").speed == 1.0
    assert load.view("r3").busy_speed == pytest.approx(1 / 3)
    assert load.view("r0").busy_speed == 1.0  # within the tolerance of the median
    few = LoadTracker()
    feed_standing_queue(few, "r0", 3, 0.2)
    assert few.view("r0").busy_speed is None  # too few first tokens yet
    fixed = LoadTracker(prefill_tokens_per_s=9000.0)
    feed_standing_queue(fixed, "r3", 30, 0.6)
    assert fixed.view("r3").busy_speed == 1.0
    # Once the replica's own rate is learned, its speed says it and busy_speed steps aside.
    learned = LoadTracker()
    for name in REPLICAS:
        feed_replica(learned, name, 40, 0.05, 0.05)
    assert learned.view("r0").busy_speed is None


def route_follow_up(settings: dict | None = None, **view) -> Decision:
    """r0 holds a prefix and has 20 requests in flight, the others 5 each and (unless `view`
    says otherwise) 2,000 tokens of prefill queued; the decision for the next request with
    that prefix under prefix_affinity with `settings`, each view's other fields from `view`
    (a value for r0 and one for the rest)."""
    view.setdefault("pending_prefill_tokens", (0.0, 2000.0))
    router = make_router(balance_horizon=0, **(settings or {}))
    router.route(router.request_from_text(chat_text(system_prompt(31), "q")),
                 [ReplicaView(name="r0")])
    views = [ReplicaView(name=n, inflight=20 if n == "r0" else 5,
                         **{k: v[0] if n == "r0" else v[1] for k, v in view.items()})
             for n in REPLICAS]
    return router.route(router.request_from_text(chat_text(system_prompt(31), "next")), views)


@pytest.mark.parametrize("speed_bound", [0.75, None])
def test_a_fast_replica_keeps_its_prefix_with_more_in_flight_than_the_mean(
        speed_bound: float | None) -> None:
    # r0 is four times as fast as the others, so at the same load it holds more requests in
    # flight: 20 against 5. With one bound for all (ceil(1.25 x 36 / 4) + 4 = 16) it is
    # over it, and the request for the prefix it holds goes to a slow replica as a miss;
    # scaled by its speed over the mean speed, its bound is 30 and the request stays.
    decision = route_follow_up({"speed_bound": speed_bound}, speed=(1.6, 0.4))
    if speed_bound is not None:
        assert (decision.replica, decision.reason) == ("r0", REASON_AFFINITY)
    else:
        assert decision.reason == REASON_OVERFLOW and decision.replica != "r0"


def test_the_bound_is_raised_only_on_a_busy_fleet_whose_slower_replicas_are_queued() -> None:
    # The slow replicas idle: a request turned away from r0 is prefilled at once there, and
    # the common bound (16) keeps r0 from taking all the prefill.
    idle_slow = route_follow_up(speed=(1.6, 0.4), pending_prefill_tokens=(0.0, 0.0))
    assert idle_slow.reason == REASON_OVERFLOW
    # Three of four replicas queued is not busy enough for a bound of 1.0 (every replica).
    assert route_follow_up({"speed_bound": 1.0}, speed=(1.6, 0.4)).reason == REASON_OVERFLOW


def test_the_bound_is_never_lowered_and_equal_speeds_keep_the_common_one() -> None:
    # r0 the slow one: its bound stays the common one (16), which 20 in flight exceeds.
    assert route_follow_up(speed=(0.4, 1.6)).reason == REASON_OVERFLOW
    assert route_follow_up(speed=(1.0, 1.0)).reason == REASON_OVERFLOW


@pytest.mark.parametrize("busy", [True, False])
def test_until_speeds_are_learned_the_bound_follows_the_busy_speed(busy: bool) -> None:
    # No replica's own rate is learned yet (speed 1 everywhere); their throughput while busy
    # says the others are a quarter of r0's speed. (Requests in flight cost nothing here, so
    # the bound alone decides.)
    decision = route_follow_up({"busy_speed": busy, "inflight_tokens": 0.0},
                               busy_speed=(1.0, 0.25))
    assert (decision.replica == "r0") == busy


OFF = {"own_speed": False}


def cold_spread(speeds: dict[str, float], settings: dict) -> Counter[str]:
    """Where 40 cold prompts go on an idle fleet of these speeds (every view idle)."""
    router = make_router(**settings)
    views = [ReplicaView(name=n, speed=speeds[n]) for n in REPLICAS]
    return Counter(router.route(router.request_from_text(
        chat_text(system_prompt(700 + i), "q")), views).replica for i in range(40))


def test_on_an_idle_mixed_fleet_own_speed_sends_cold_prompts_to_the_fast_replicas() -> None:
    # r0 and r1 prefill four times as fast as r2 and r3. Idle, a request's TTFT is its own
    # prefill there; priced whole, an idle slow replica looks as cheap as an idle fast one
    # and balancing gives the slow ones their share.
    speeds = {"r0": 1.6, "r1": 1.6, "r2": 0.4, "r3": 0.4}
    assert set(cold_spread(speeds, {})) <= {"r0", "r1"}
    off = cold_spread(speeds, OFF)
    assert off["r2"] + off["r3"] > 0


def test_on_an_idle_mixed_fleet_requests_in_flight_do_not_outweigh_speed() -> None:
    # Every replica holds the hot prompt; r0 and r1 are four times as fast and have 20
    # requests decoding each, r2 and r3 three. With nothing queued anywhere, decoding
    # requests lengthen the next step by a millisecond or so each: the request's own
    # prefill decides, and it is four times shorter on a fast replica. Counted whole (256
    # tokens each, as on a busy fleet), the in-flight requests sent it to a slow one.
    router = make_router(balance_horizon=0)
    text = chat_text(system_prompt(41), "q")
    for name in REPLICAS:
        router.route(router.request_from_text(text), [ReplicaView(name=name)])
    views = [ReplicaView(name=n, inflight=20 if n in ("r0", "r1") else 3,
                         speed=1.6 if n in ("r0", "r1") else 0.4) for n in REPLICAS]
    picks = {router.route(router.request_from_text(chat_text(system_prompt(41), f"u{i}")),
                          views).replica for i in range(10)}
    assert picks <= {"r0", "r1"}


def test_own_speed_leaves_speeds_within_its_spread_alone() -> None:
    # Equal replicas' learned speeds stray (on long chunked prompts, to two thirds of the
    # pool's rate): within own_speed_spread (2) of it, the decisions are the defaults'.
    speeds = {"r0": 1.4, "r1": 1.0, "r2": 1.0, "r3": 0.6}
    assert cold_spread(speeds, {}) == cold_spread(speeds, OFF)


def test_own_speed_prices_one_replica_far_off_the_pools_speed() -> None:
    # One replica of four four times slower (throttled, or sharing its GPU): the fleet is
    # not one of mixed speeds (the quartiles are equal), but a request's own prefill there
    # takes four times as long, so an idle slow replica is not as cheap as an idle fast one.
    speeds = {"r0": 1.0, "r1": 1.0, "r2": 1.0, "r3": 0.25}
    # Without it, balancing by time still gives r3 a share of the cold prompts.
    off = cold_spread(speeds, OFF)
    assert off["r3"] > 0, off
    assert cold_spread(speeds, {})["r3"] == 0
    assert cold_spread(speeds, {"own_speed_outliers": False}) == off


def test_own_speed_keeps_a_fast_replicas_prefix_on_an_idle_fleet() -> None:
    # No replica has prefill queued, so speed_bound does not raise r0's bound (16) and,
    # without own_speed, the request for its prefix leaves as a miss; with it the bound is
    # scaled by r0's speed over the mean and the request stays. (One fast replica of four:
    # the quartiles are equal, so the spread is lowered to let own_speed act.)
    idle_fleet = {"speed": (1.6, 0.4), "pending_prefill_tokens": (0.0, 0.0)}
    assert route_follow_up(OFF, **idle_fleet).reason == REASON_OVERFLOW
    decision = route_follow_up({"own_speed_spread": 1.0}, **idle_fleet)
    assert (decision.replica, decision.reason) == ("r0", REASON_AFFINITY)


def test_gateways_sharing_decisions_break_a_tie_between_holders_alike() -> None:
    """A prefix held by two replicas (a spill made a second copy) is a tie that balancing
    breaks on recent prefill. Balancing on its own decisions alone, a gateway that routed
    little chose one holder and a gateway that routed the rest the other; told of each
    other's decisions (with their prefill), both balance on the same fleet-wide figures."""
    def pair(shared: bool) -> tuple[str, str]:
        a, b = make_router(), make_router()
        if shared:
            a.on_record = lambda replica, hashes, cost, held, output: b.apply_remote_inserts(
                [(replica, hashes, cost)])
            b.on_record = lambda replica, hashes, cost, held, output: a.apply_remote_inserts(
                [(replica, hashes, cost)])
        text = chat_text(system_prompt(11), "q")
        for name in ("r0", "r1"):  # both hold it, in both routers' indexes
            a.route(a.request_from_text(text), [ReplicaView(name=name)])
            b.apply_remote_inserts([(name, a.request_from_text(text).hashes, 0.0)])
        # Cold prompts through A only: all of A's recent prefill on r0, then on r1 more.
        for i in range(2):
            a.route(a.request_from_text(chat_text(system_prompt(100 + i), "x")),
                    [ReplicaView(name="r0")])
        for i in range(3):
            a.route(a.request_from_text(chat_text(system_prompt(200 + i), "x")),
                    [ReplicaView(name="r1")])
        views = [ReplicaView(name="r0"), ReplicaView(name="r1")]
        request = a.request_from_text(chat_text(system_prompt(11), "next"))
        return (a.policy.choose(request, views, a).replica,
                b.policy.choose(request, views, b).replica)

    assert pair(shared=True) == ("r0", "r0")
    apart = pair(shared=False)
    assert apart[0] == "r0" and apart[1] != "r0"  # what sharing only the index gave


def test_a_replica_whose_engine_reports_requests_waiting_is_not_credited_the_drain() -> None:
    # Every replica has sent 20k tokens of prefill that the learned rate says are computed by
    # now; r1's engine says requests are waiting with its KV cache nearly full, so it cannot
    # admit them and what it was sent is not being computed: counted whole, cold prompts avoid
    # it. With KV to spare the queue is ordinary and drains; with the setting off, likewise.
    def spread(stops: bool, kv_usage: float) -> Counter[str]:
        router = make_router(load_factor=100.0, waiting_stops_drain=stops, balance_horizon=0)
        views = [ReplicaView(name=n, inflight=4, pending_prefill_tokens=20_000.0,
                             prefill_left_tokens=0.0, engine_waiting=3 if n == "r1" else 0,
                             kv_usage=kv_usage if n == "r1" else 0.5) for n in REPLICAS]
        return Counter(router.route(router.request_from_text(
            chat_text(system_prompt(900 + i), "q")), views).replica for i in range(60))

    assert spread(True, 0.95)["r1"] == 0
    assert spread(True, 0.5)["r1"] > 5
    assert spread(False, 0.95)["r1"] > 5


@pytest.mark.parametrize("cap", [True, False])
def test_a_fast_replica_out_of_kv_is_not_priced_as_draining_fast(cap: bool) -> None:
    # r0 is four times as fast as the others and has twice their queue: divided by its speed
    # the queue looks half as long. But its engine reports requests waiting with its KV cache
    # nearly full: it admits nothing until requests finish, so its speed does not shorten the
    # wait there, and with the cap cold prompts go to the slow replicas instead.
    def spread(kv_usage: float) -> Counter[str]:
        router = make_router(load_factor=100.0, balance_horizon=0, blocked_speed_cap=cap)
        views = [ReplicaView(name=n, inflight=4,
                             pending_prefill_tokens=8000.0 if n == "r0" else 3000.0,
                             speed=4.0 if n == "r0" else 1.0,
                             engine_waiting=3 if n == "r0" else 0,
                             kv_usage=kv_usage if n == "r0" else 0.5) for n in REPLICAS]
        return Counter(router.route(router.request_from_text(
            chat_text(system_prompt(700 + i), "q")), views).replica for i in range(60))

    assert (spread(0.98)["r0"] == 0) == cap
    assert spread(0.5)["r0"] == 60  # KV to spare: its queue drains at its own speed


def test_decode_steps_are_timed_at_the_engines_batch_with_other_gateways_requests() -> None:
    # One request of this gateway's decodes on r0 beside 1 to 7 of other gateways': the
    # engine's batch, which sets the step's length (10 ms a sequence here), is the sum.
    # Timed at this gateway's own batch (always 1), the steps looked like noise around one
    # length, and a gateway that sent a replica few requests misjudged its decode speed.
    load = LoadTracker()
    load.dispatched("r0", 0.0)
    load.first_token("r0", 0.0)
    t = 0.0
    for i in range(60):
        others = 1 + abs(6 - i % 12)  # 7, 6, ... 1, 2, ... 7: the batch moves a step at a time
        load.set_remote(sum_loads([{"r0": [others, 0.0, 0.0]}]))
        t += 0.01 * (1 + others)
        load.chunk("r0", t)  # a step of 1 + others sequences ends
    assert load.batch("r0") == 1 + 1 + abs(6 - 59 % 12)
    assert load.steps.decode_s(8) == pytest.approx(0.08, rel=0.05)
    assert load.steps.decode_s(2) == pytest.approx(0.02, rel=0.05)


def test_a_replicas_throughput_while_busy_counts_what_other_gateways_timed() -> None:
    # Under a standing queue no step teaches a replica's own rate; its throughput while busy
    # does (`busy_speed`), from first tokens. Each of two gateways saw 6 of r3's, and of each
    # other replica's: fewer than either needs alone, enough together.
    def first_tokens(steps: StepTimer, name: str, seconds_each: float) -> None:
        for i in range(6):
            steps.prefill_done(name, 1000.0, (i + 1) * seconds_each,
                               dispatched_at=i * seconds_each)

    a, b = StepTimer(), StepTimer()
    for steps in (a, b):
        for name in ("r0", "r1", "r2"):
            first_tokens(steps, name, 0.1)
        first_tokens(steps, "r3", 0.4)  # four times slower
    assert a.busy_speed("r3") is None
    a.set_remote_rates(sum_rates([b.own_rates()]))
    assert a.busy_speed("r3") == pytest.approx(0.25, rel=0.02)
    assert a.busy_speed("r0") == 1.0
    # An older gateway shares its rates alone: no throughput comes with them.
    assert sum_rates([{"r0": [1000.0, 0.1, 1, 0]}])["r0"] == (1000.0, 0.1, 1, 0, 0.0, 0.0, 0)
