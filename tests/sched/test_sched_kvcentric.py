"""kvcentric: every branch of Mooncake's Algorithm 1 on scripted snapshots, exact placements.

Costs are those of sched_support (exact in binary): prefill 2**-10 s/token, a fetch of k blocks
(k + 1) * 2**-7 s, a decode step 2**-7 + batch * 2**-10 s. The prompt has 161 tokens: 10 full blocks
plus one token, so at most 10 prefix blocks and at least 1 computed token.
"""

from __future__ import annotations

from yutu.sched import ClusterView, Placement, PrefixPlan, QueuedPrefill, RunningDecode, policy_by_name

from tests.sched.sched_support import (
    PROMPT,
    cluster,
    costs,
    decode,
    prefill,
    prefill_time,
    request,
    step,
    transfer_time,
)


def place(view: ClusterView, **options: object) -> Placement:
    out = policy_by_name("kvcentric", costs=costs(), **options).place(view, request(), 0.0)
    assert isinstance(out, Placement), out
    return out


def test_no_prefix_anywhere_computes_the_whole_prompt() -> None:
    out = place(cluster((prefill("p0"),), (decode("d0"),)))
    assert (out.prefill_id, out.decode_id) == ("p0", "d0")
    assert out.plan == PrefixPlan(local_blocks=0, fetch_end=0, compute_tokens=PROMPT)
    assert out.ttft_s == prefill_time(PROMPT)
    assert out.ready_at_s == out.ttft_s
    assert out.tbt_s == step(1)
    assert out.policy == "kvcentric"


def test_local_prefix_zero_fetches_what_the_store_holds() -> None:
    # local 0: the balancing ratio is unbounded, so the store's 6 blocks are weighed; they pay.
    out = place(cluster((prefill("p0"),), (decode("d0"),), store=6))
    assert out.plan == PrefixPlan(local_blocks=0, fetch_end=6, compute_tokens=PROMPT - 96)
    assert out.ttft_s == transfer_time(6) + prefill_time(PROMPT - 96)


def test_balancing_ratio_above_threshold_fetches_at_or_below_keeps_local() -> None:
    view = cluster((prefill("p0", local=4),), (decode("d0"),), store=6)  # reach / local = 6 / 4 = 1.5
    fetched = PrefixPlan(local_blocks=4, fetch_end=6, compute_tokens=PROMPT - 96)
    kept = PrefixPlan(local_blocks=4, fetch_end=4, compute_tokens=PROMPT - 64)
    assert place(view).plan == fetched  # default threshold 1.0
    assert place(view, balancing_threshold=1.49).plan == fetched
    assert place(view, balancing_threshold=1.5).plan == kept  # strictly above is required
    out = place(view, balancing_threshold=2.0)
    assert out.plan == kept
    assert out.ttft_s == prefill_time(PROMPT - 64)


def test_fetch_or_recompute_follows_the_cost_models_both_ways() -> None:
    # One more block: fetching costs 2 * 2**-7 = 2**-6 s, exactly the 16 tokens' compute: recompute.
    one = place(cluster((prefill("p0", local=4),), (decode("d0"),), store=5))
    assert one.plan == PrefixPlan(local_blocks=4, fetch_end=4, compute_tokens=PROMPT - 64)
    assert one.ttft_s == prefill_time(PROMPT - 64)
    assert "recompute" in one.reason
    # Two more blocks: 3 * 2**-7 s < 2 * 2**-6 s saved: fetch.
    two = place(cluster((prefill("p0", local=4),), (decode("d0"),), store=6))
    assert two.plan == PrefixPlan(local_blocks=4, fetch_end=6, compute_tokens=PROMPT - 96)
    assert two.ttft_s == transfer_time(2) + prefill_time(PROMPT - 96)
    # The instance's own measured bandwidth wins over the shared model: at 1000 B/s a block takes 1 s.
    slow = place(cluster((prefill("p0", local=4, bandwidth_bps=1000.0),), (decode("d0"),), store=10))
    assert slow.plan == PrefixPlan(local_blocks=4, fetch_end=4, compute_tokens=PROMPT - 64)


def test_store_run_after_the_local_prefix_is_fetchable_even_without_block_zero() -> None:
    keys = request().block_keys
    out = place(cluster((prefill("p0", local=3),), (decode("d0"),), store=frozenset(keys[3:8])))
    assert out.plan == PrefixPlan(local_blocks=3, fetch_end=8, compute_tokens=PROMPT - 128)


def test_the_last_prompt_token_is_always_computed() -> None:
    # A 160-token prompt is exactly 10 blocks, all cached everywhere: only 9 may be reused.
    view = cluster((prefill("p0", local=10),), (decode("d0"),), store=10)
    out = policy_by_name("kvcentric", costs=costs()).place(view, request(prompt_len=160), 0.0)
    assert isinstance(out, Placement)
    assert out.plan == PrefixPlan(local_blocks=9, fetch_end=9, compute_tokens=16)


def test_queue_time_outweighs_a_longer_prefix() -> None:
    busy = prefill("long", local=9, queue=(QueuedPrefill(200),))  # 200/1024 + 17/1024 s
    idle = prefill("short")  # 161/1024 s
    out = place(cluster((busy, idle), (decode("d0"),)))
    assert out.prefill_id == "short"
    assert out.ttft_s == prefill_time(PROMPT)
    # A shorter queue there, and the prefix wins: 100/1024 + 17/1024 s.
    lighter = prefill("long", local=9, queue=(QueuedPrefill(100),))
    out = place(cluster((lighter, idle), (decode("d0"),)))
    assert out.prefill_id == "long"
    assert out.ttft_s == prefill_time(100) + prefill_time(PROMPT - 144)


def test_queue_counts_only_the_work_left_of_each_queued_prompt() -> None:
    # 50 tokens left of a 200-token prompt (50 reused, 100 computed) + the 17 new ones.
    partly = prefill("p0", local=9, queue=(QueuedPrefill(200, reused_tokens=50, computed_tokens=100),))
    out = place(cluster((partly,), (decode("d0"),)))
    assert out.ttft_s == prefill_time(50) + prefill_time(PROMPT - 144)


def test_ties_go_to_the_shorter_queue_then_the_lowest_id() -> None:
    # Equal TTFT 161/1024 s: "a" reuses 2 blocks behind a 32-token queue, "b" computes it all, idle.
    a = prefill("a", local=2, queue=(QueuedPrefill(32),))
    b = prefill("b")
    assert place(cluster((a, b), (decode("d0"),))).prefill_id == "b"
    # Identical instances, in either order: the lowest id.
    assert place(cluster((prefill("y"), prefill("x")), (decode("d1"), decode("d0")))).prefill_id == "x"
    assert place(cluster((prefill("x"), prefill("y")), (decode("d0"), decode("d1")))).decode_id == "d0"


def test_decode_with_the_least_tbt_when_the_prefill_ends() -> None:
    # d0 has 4 sequences now, each with 1 token left: gone after one step, long before the prefill ends.
    emptying = decode("d0", running=tuple(RunningDecode(100, 1) for _ in range(4)))
    steady = decode("d1", running=tuple(RunningDecode(100, 1000) for _ in range(2)))
    view = cluster((prefill("p0"),), (emptying, steady))
    out = place(view)
    assert out.decode_id == "d0"
    assert out.tbt_s == step(1)
    # least_loaded judges today's load and picks the other one.
    other = policy_by_name("least_loaded", costs=costs()).place(view, request(), 0.0)
    assert isinstance(other, Placement)
    assert other.decode_id == "d1"
    assert other.tbt_s == step(3)
