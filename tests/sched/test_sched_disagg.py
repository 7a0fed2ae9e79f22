"""Conditional disaggregation, and where the prefill runs when no prefill instance can (exact placements)."""

from __future__ import annotations

import pytest
from yutu.errors import ErrorKind
from yutu.sched import (
    POLICIES,
    ClusterView,
    Placement,
    PrefixPlan,
    RejectCause,
    Rejection,
    RunningDecode,
    policy_by_name,
)

from tests.sched.sched_support import (
    PROMPT,
    cluster,
    costs,
    decode,
    held,
    prefill,
    prefill_time,
    request,
    step,
    transfer_time,
)

ALL = sorted(POLICIES)


def place(name: str, view: ClusterView, **options: object) -> Placement | Rejection:
    return policy_by_name(name, costs=costs(), **options).place(view, request(), 0.0)


# The decode holds 9 of the 10 usable blocks: 161 - 144 = 17 tokens stay uncached.
NEAR = cluster((prefill("p0"),), (decode("d0", cached=held(9)),))


@pytest.mark.parametrize("name", ALL)
def test_at_the_threshold_the_decode_prefills_itself(name: str) -> None:
    out = place(name, NEAR, disagg_threshold=17)
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id, out.local_prefill) == (None, "d0", True)
    assert out.plan == PrefixPlan(local_blocks=9, fetch_end=9, compute_tokens=17)
    assert out.ttft_s == prefill_time(17)  # an idle decode waits for no step
    assert out.tbt_s == step(1)
    assert "17 uncached tokens <= disagg_threshold 17" in out.reason


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("threshold", [16, 0])
def test_below_the_threshold_or_off_the_prefill_instance_runs_it(name: str, threshold: int) -> None:
    out = place(name, NEAR, disagg_threshold=threshold)
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id) == ("p0", "d0")
    assert out.plan == PrefixPlan(local_blocks=0, fetch_end=0, compute_tokens=PROMPT)


def test_store_hits_count_toward_the_threshold_and_the_decode_fetches_them() -> None:
    # d0 holds 5 blocks, the store all 10: 1 token uncached. Fetching 5 blocks (6 * 2**-7 s) pays.
    view = cluster((prefill("p0"),), (decode("d0", cached=held(5)),), store=10)
    out = place("kvcentric", view, disagg_threshold=1)
    assert isinstance(out, Placement)
    assert out.prefill_id is None
    assert out.plan == PrefixPlan(local_blocks=5, fetch_end=10, compute_tokens=1)
    assert out.ttft_s == transfer_time(5) + prefill_time(1)


def test_a_busy_decode_prefills_in_its_next_step() -> None:
    busy = decode("d0", cached=held(9), running=(RunningDecode(50, 1000), RunningDecode(50, 1000)))
    out = place("kvcentric", cluster((prefill("p0"),), (busy,)), disagg_threshold=17)
    assert isinstance(out, Placement)
    assert out.prefill_id is None
    assert out.ttft_s == step(2) + prefill_time(17)
    assert out.tbt_s == step(3)


@pytest.mark.parametrize("name", ALL)
def test_no_prefill_instance_live_the_decode_prefills(name: str) -> None:
    out = place(name, cluster((), (decode("d0", cached=held(2)),)))
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id) == (None, "d0")
    assert out.plan == PrefixPlan(local_blocks=2, fetch_end=2, compute_tokens=PROMPT - 32)
    assert "no prefill instance is live" in out.reason


def test_no_prefill_instance_with_room_the_decode_prefills() -> None:
    # 11 blocks needed (nothing reused), 10 free.
    out = place("kvcentric", cluster((prefill("p0", free=10),), (decode("d0"),)))
    assert isinstance(out, Placement)
    assert out.prefill_id is None
    assert "no prefill instance has free KV blocks" in out.reason


BUSY = (RunningDecode(50, 1000), RunningDecode(50, 1000))  # two sequences decoding for a long while
FULL = (prefill("p0", free=10),)  # the prompt needs 11 blocks: no prefill instance has room


@pytest.mark.parametrize("options", [{}, {"slo_tbt_s": 0.1}])
def test_an_overflow_prefill_that_would_stall_a_busy_batch_queues_on_a_prefill_instance(
    options: dict[str, object],
) -> None:
    # Unchunked, the whole prefill (161/1024 s) would ride one step of the two sequences: step(3)
    # + 0.157 s > 0.1 s. Without a TBT SLO a busy batch is never stalled for an overflow.
    out = place("kvcentric", cluster(FULL, (decode("d0", running=BUSY),)), **options)
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id) == ("p0", "d0")
    assert out.ttft_s == prefill_time(PROMPT)
    assert "queued there, as no decode instance can take its prefill's stall" in out.reason


def test_under_a_ttft_slo_a_prefill_no_instance_has_blocks_for_is_rejected_not_queued() -> None:
    # Its wait for blocks is not forecast, so the conductor cannot promise its TTFT: a 429 now.
    out = place("kvcentric", cluster(FULL, (decode("d0", running=BUSY),)), slo_tbt_s=0.1, slo_ttft_s=5.0)
    assert isinstance(out, Rejection)
    assert out.cause is RejectCause.NO_CAPACITY
    assert "no prefill instance has free KV blocks for it, and no decode instance can take" in out.reason


def test_a_chunked_overflow_prefill_runs_on_a_decode_that_can_carry_its_chunks() -> None:
    # 16-token chunks: the dearest costs 16/1024 s; step(2) + 16/1024 s <= 0.1 s.
    busy = decode("d0", running=BUSY, chunk_tokens=16)
    out = place("kvcentric", cluster(FULL, (busy,)), slo_tbt_s=0.1)
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id) == (None, "d0")
    assert out.ttft_s == step(2) + prefill_time(PROMPT)
    assert "no prefill instance has free KV blocks for it" in out.reason


def test_an_overflow_prefill_goes_to_the_decode_it_does_not_hurt() -> None:
    # d0 is busy (unchunked: it cannot take the stall), d1 idle: d1 prefills it.
    out = place("kvcentric", cluster(FULL, (decode("d0", running=BUSY), decode("d1"))), slo_tbt_s=0.1)
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id) == (None, "d1")


@pytest.mark.parametrize("name", ALL)
def test_no_decode_instance_is_unavailable(name: str) -> None:
    out = place(name, cluster((prefill("p0"),), ()))
    assert isinstance(out, Rejection)
    assert out.cause is RejectCause.NO_DECODE
    assert out.error_kind is ErrorKind.UNAVAILABLE
    assert out.error_kind.http_status == 503
    assert out.reason == f"{name}: no decode instance is live"
    assert out.retry_after_s == 5.0
    assert (out.ttft_s, out.tbt_s) == (None, None)
