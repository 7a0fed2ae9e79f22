"""round_robin, least_loaded, cache_aware; the registry and options; determinism."""

from __future__ import annotations

import random

import pytest
from yutu.sched import (
    POLICIES,
    ClusterView,
    DecodeView,
    IncomingDecode,
    KVCentric,
    Placement,
    PolicyOptions,
    PrefillView,
    PrefixPlan,
    QueuedPrefill,
    Rejection,
    RequestView,
    RunningDecode,
    policy_by_name,
)

from tests.sched.sched_support import PROMPT, cluster, costs, decode, prefill, request


def placements(name: str, view: ClusterView, n: int) -> list[tuple[str | None, str]]:
    policy = policy_by_name(name, costs=costs())
    out = []
    for i in range(n):
        p = policy.place(view, request(rid=f"r{i}"), float(i))
        assert isinstance(p, Placement), p
        out.append((p.prefill_id, p.decode_id))
    return out


def test_round_robin_takes_instances_in_turn() -> None:
    view = cluster((prefill("p2"), prefill("p0"), prefill("p1")), (decode("d1"), decode("d0")))
    assert placements("round_robin", view, 4) == [("p0", "d0"), ("p1", "d1"), ("p2", "d0"), ("p0", "d1")]


def test_round_robin_skips_instances_without_room() -> None:
    view = cluster((prefill("p0"), prefill("p1", free=0), prefill("p2")), (decode("d0"),))
    assert [p for p, _ in placements("round_robin", view, 3)] == ["p0", "p2", "p0"]


def test_round_robin_ignores_cache_and_load_but_still_weighs_the_fetch() -> None:
    # p0 comes first in turn despite p1's cache; its plan still fetches the store's 6 blocks (they pay).
    view = cluster(
        (prefill("p0", queue=(QueuedPrefill(1000),)), prefill("p1", local=9)), (decode("d0"),), store=6
    )
    out = policy_by_name("round_robin", costs=costs()).place(view, request(), 0.0)
    assert isinstance(out, Placement)
    assert out.prefill_id == "p0"
    assert out.plan == PrefixPlan(local_blocks=0, fetch_end=6, compute_tokens=PROMPT - 96)


def test_least_loaded_prefers_the_least_queued_work() -> None:
    # Seconds of work, not queue length: p0 has one long prompt, p1 two short ones.
    p0 = prefill("p0", local=9, queue=(QueuedPrefill(1000),))
    p1 = prefill("p1", queue=(QueuedPrefill(100), QueuedPrefill(100)))
    p2 = prefill("p2", queue=(QueuedPrefill(300, reused_tokens=200),))  # 100 tokens left
    view = cluster((p0, p1, p2), (decode("d0"),))
    assert placements("least_loaded", view, 1) == [("p2", "d0")]


def test_least_loaded_decode_counts_incoming_requests() -> None:
    d0 = decode("d0", running=(RunningDecode(10, 1000),))
    d1 = decode("d1", incoming=(IncomingDecode(50.0, 10, 10), IncomingDecode(50.0, 10, 10)))
    d2 = decode("d2", running=(RunningDecode(500, 1000),))  # same count as d0, more KV
    view = cluster((prefill("p0"),), (d1, d2, d0))
    assert placements("least_loaded", view, 1) == [("p0", "d0")]


def test_cache_aware_prefers_the_longest_local_prefix_then_the_least_work() -> None:
    long_busy = prefill("a", local=9, queue=(QueuedPrefill(1000),))
    long_idle = prefill("b", local=9, queue=(QueuedPrefill(10),))
    short = prefill("c", local=3)
    view = cluster((short, long_busy, long_idle), (decode("d0"),))
    assert placements("cache_aware", view, 1) == [("b", "d0")]
    # kvcentric weighs the same view by TTFT: "b" still wins (10 + 17 tokens vs 113 for "c").
    assert placements("kvcentric", view, 1) == [("b", "d0")]


def test_cache_aware_and_kvcentric_part_when_the_queue_outweighs_the_prefix() -> None:
    view = cluster(
        (prefill("a", local=9, queue=(QueuedPrefill(1000),)), prefill("b", local=3)), (decode("d0"),)
    )
    assert placements("cache_aware", view, 1) == [("a", "d0")]
    assert placements("kvcentric", view, 1) == [("b", "d0")]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_same_inputs_same_outputs_whatever_the_snapshot_order(name: str) -> None:
    rng = random.Random(7)
    prefills = [
        prefill(f"p{i}", local=rng.randrange(10), queue=(QueuedPrefill(rng.randrange(1, 500)),))
        for i in range(6)
    ]
    decodes = [
        decode(f"d{i}", running=tuple(RunningDecode(50, rng.randrange(1, 50)) for _ in range(i)))
        for i in range(4)
    ]
    reqs = [RequestView(f"r{i}", request().block_keys[: rng.randrange(11)], PROMPT, 8) for i in range(20)]

    def run(ps: list[PrefillView], ds: list[DecodeView]) -> list[Placement | Rejection]:
        policy = policy_by_name(name, costs=costs(), disagg_threshold=40, slo_ttft_s=0.5)
        view = cluster(tuple(ps), tuple(ds), store=5)
        return [policy.place(view, r, i * 0.01) for i, r in enumerate(reqs)]

    first = run(prefills, decodes)
    rng.shuffle(prefills)
    rng.shuffle(decodes)
    assert run(prefills, decodes) == first
    assert any(isinstance(p, Placement) for p in first)


def test_policy_by_name_builds_each_policy_with_its_options() -> None:
    shared = costs()
    p = policy_by_name("kvcentric", costs=shared, balancing_threshold=2.0, disagg_threshold=32, slo_tbt_s=0.1)
    assert isinstance(p, KVCentric)
    assert p.name == "kvcentric"
    assert p.options == PolicyOptions(balancing_threshold=2.0, disagg_threshold=32, slo_tbt_s=0.1)
    assert p.costs is shared
    assert sorted(POLICIES) == [
        "cache_aware",
        "kvcentric",
        "kvcentric_affinity",
        "least_loaded",
        "round_robin",
    ]
    assert all(policy_by_name(n).name == n for n in POLICIES)


def test_policy_by_name_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match=r"unknown placement policy 'fastest'; choose one of round_robin, "):
        policy_by_name("fastest")
    with pytest.raises(ValueError, match=r"unknown policy option\(s\) \['slo_ttft'\]; valid options are"):
        policy_by_name("kvcentric", slo_ttft=1.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"balancing_threshold": 0.5}, "balancing_threshold must be a finite number >= 1.0"),
        ({"balancing_threshold": float("nan")}, "balancing_threshold must be a finite number >= 1.0"),
        ({"disagg_threshold": -1}, r"disagg_threshold must be an integer number of tokens >= 0 \(0 = off\)"),
        ({"disagg_threshold": 1.5}, "disagg_threshold must be an integer"),
        ({"slo_ttft_s": 0.0}, r"slo_ttft_s must be a positive number of seconds or None \(no SLO\)"),
        ({"slo_tbt_s": float("inf")}, "slo_tbt_s must be a positive number"),
    ],
)
def test_invalid_options_say_what_to_use(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyOptions(**options)


def test_snapshots_reject_inconsistent_input() -> None:
    with pytest.raises(ValueError, match="duplicate prefill instance ids"):
        cluster((prefill("p0"), prefill("p0")), (decode("d0"),))
    with pytest.raises(ValueError, match="hash with the cluster's block size"):
        policy_by_name("kvcentric").place(
            cluster((), (decode("d0"),)), RequestView("r", request().block_keys, 100, 1), 0.0
        )
    with pytest.raises(ValueError, match="now must be a finite time"):
        policy_by_name("kvcentric").place(cluster((), (decode("d0"),)), request(), float("nan"))
    with pytest.raises(ValueError, match="exceed prompt_len"):
        QueuedPrefill(10, reused_tokens=6, computed_tokens=5)


def test_kvcentric_affinity_trades_a_little_ttft_for_the_local_prefix() -> None:
    # TTFT in tokens of 2**-10 s (161-token prompt, no store): "a" 20 queued + 65 uncached = 85,
    # "b" 161, "c" 64 + 17 = 81: "c" is the fastest and holds the most; both take it.
    view = cluster(
        (
            prefill("a", local=6, queue=(QueuedPrefill(20),)),
            prefill("b"),
            prefill("c", local=9, queue=(QueuedPrefill(64),)),
        ),
        (decode("d0"),),
    )
    assert placements("kvcentric", view, 1) == [("c", "d0")]
    assert placements("kvcentric_affinity", view, 1) == [("c", "d0")]
    # Now "a" is the fastest (an empty queue: 65 tokens) and "c" (9 blocks, 81 tokens) is within
    # 30% of it: affinity takes the longer local prefix, kvcentric the least TTFT.
    view = cluster(
        (prefill("a", local=6), prefill("c", local=9, queue=(QueuedPrefill(64),))), (decode("d0"),)
    )
    assert placements("kvcentric", view, 1) == [("a", "d0")]
    assert placements("kvcentric_affinity", view, 1) == [("c", "d0")]
    # Beyond 30% (a queue of 100 tokens: 117 > 65 * 1.3) affinity keeps the fastest.
    view = cluster(
        (prefill("a", local=6), prefill("c", local=9, queue=(QueuedPrefill(100),))), (decode("d0"),)
    )
    assert placements("kvcentric_affinity", view, 1) == [("a", "d0")]
