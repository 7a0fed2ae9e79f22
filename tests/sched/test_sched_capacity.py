"""Instances that cannot take the request (KV blocks, batch room) are excluded; none left: NO_CAPACITY."""

from __future__ import annotations

import pytest
from yutu.errors import ErrorKind
from yutu.sched import (
    ClusterView,
    IncomingDecode,
    Placement,
    RejectCause,
    Rejection,
    RunningDecode,
    policy_by_name,
)

from tests.sched.sched_support import PROMPT, cluster, costs, decode, prefill, prefill_time, request, step


def place(view: ClusterView, name: str = "kvcentric", **options: object) -> Placement | Rejection:
    return policy_by_name(name, costs=costs(), **options).place(view, request(), 0.0)


SLO = {"slo_ttft_s": 1e6}  # an SLO is set (never missed here): capacity shortfalls are rejected


@pytest.mark.parametrize(("free", "chosen"), [(1, "cold"), (2, "warm")])
def test_prefill_needs_blocks_for_all_but_its_reused_prefix(free: int, chosen: str) -> None:
    # 161 tokens = 11 blocks; "warm" reuses 9 locally, so it needs 2 free blocks.
    view = cluster((prefill("warm", local=9, free=free), prefill("cold", free=11)), (decode("d0"),))
    out = place(view)
    assert isinstance(out, Placement)
    assert out.prefill_id == chosen


@pytest.mark.parametrize(("free", "chosen"), [(23, "d1"), (24, "d0")])
def test_decode_blocks_count_what_incoming_requests_will_take(free: int, chosen: str) -> None:
    # The request needs ceil(162 / 16) = 11 blocks; d0's incoming 200-token request takes 13.
    # It arrives long after this prefill ends, so d0 is idle then and wins when it has the room.
    later = IncomingDecode(arrival_s=100.0, prompt_len=200, max_tokens=4)
    d0 = decode("d0", free=free, incoming=(later,))
    d1 = decode("d1", running=(RunningDecode(10, 1000),))
    out = place(cluster((prefill("p0"),), (d0, d1)))
    assert isinstance(out, Placement)
    assert out.decode_id == chosen


@pytest.mark.parametrize(("remaining", "chosen"), [(1000, "d1"), (1, "d0")])
def test_a_batch_full_when_the_prefill_ends_is_excluded(remaining: int, chosen: str) -> None:
    # d0 runs its maximum of 2 now; with 1 token left each, both leave before the prefill ends.
    d0 = decode("d0", max_batch=2, running=(RunningDecode(10, remaining), RunningDecode(10, remaining)))
    d1 = decode("d1", running=tuple(RunningDecode(10, 1000) for _ in range(5)))
    out = place(cluster((prefill("p0"),), (d0, d1)))
    assert isinstance(out, Placement)
    assert out.decode_id == chosen


def test_no_decode_with_free_blocks_is_overloaded_until_the_first_departure() -> None:
    # One sequence with 1000 tokens left at step(1) s per token.
    d0 = decode("d0", free=10, running=(RunningDecode(10, 1000),))
    out = place(cluster((prefill("p0"),), (d0,)), **SLO)
    assert isinstance(out, Rejection)
    assert out.cause is RejectCause.NO_CAPACITY
    assert out.error_kind is ErrorKind.OVERLOADED
    assert out.reason == (
        "kvcentric: no decode instance has 11 free KV blocks for a 161-token prompt when its prefill "
        "ends (most free: 10)"
    )
    # Sent again that much later, its prefill ends when the sequence leaves.
    assert out.retry_after_s == 1000 * step(1) - prefill_time(PROMPT)


@pytest.mark.parametrize(("remaining", "placed"), [(1, True), (1000, False)])
def test_decode_blocks_are_forecast_for_the_prefill_end(remaining: int, placed: bool) -> None:
    # 10 blocks free now, 11 needed. The running sequence holds ceil(64 / 16) = 4 blocks; with one
    # token left it leaves after one step, long before the prefill ends (161/1024 s): 14 free then.
    d0 = decode("d0", free=10, running=(RunningDecode(64, remaining),))
    out = place(cluster((prefill("p0"),), (d0,)), **SLO)
    assert isinstance(out, Placement) is placed, out
    if not placed:
        assert isinstance(out, Rejection) and out.cause is RejectCause.NO_CAPACITY


def test_incoming_requests_that_leave_before_the_prefill_ends_give_their_blocks_back() -> None:
    # 11 free now; an incoming request takes 7 (100-token prompt) but arrives at 0 with 2 tokens to
    # emit: it is gone after one step, before this prefill ends. One that stays would leave 4.
    gone = IncomingDecode(arrival_s=0.0, prompt_len=100, max_tokens=2)
    stays = IncomingDecode(arrival_s=0.0, prompt_len=100, max_tokens=1000)
    assert isinstance(
        place(cluster((prefill("p0"),), (decode("d0", free=11, incoming=(gone,)),)), **SLO), Placement
    )
    out = place(cluster((prefill("p0"),), (decode("d0", free=11, incoming=(stays,)),)), **SLO)
    assert isinstance(out, Rejection) and out.cause is RejectCause.NO_CAPACITY
    assert "(most free: 4)" in out.reason


def test_every_batch_full_is_overloaded_with_a_clamped_retry() -> None:
    d0 = decode("d0", max_batch=1, running=(RunningDecode(10, 100_000),))
    out = place(cluster((prefill("p0"),), (d0,)), name="round_robin", **SLO)
    assert isinstance(out, Rejection)
    assert out.cause is RejectCause.NO_CAPACITY
    assert (
        out.reason
        == "round_robin: every decode instance with free KV blocks has a full batch when the prefill ends"
    )
    assert out.retry_after_s == 30.0  # 100000 steps away: clamped


def test_without_an_slo_a_full_cluster_queues_the_request_instead_of_refusing_it() -> None:
    blocks_short = decode("d0", free=10, running=(RunningDecode(10, 1000),))
    batch_full = decode("d1", max_batch=1, running=(RunningDecode(10, 100_000),))
    for d in (blocks_short, batch_full):
        out = place(cluster((prefill("p0"),), (d,)))
        assert isinstance(out, Placement) and out.decode_id == d.instance_id
    local = place(cluster((), (batch_full,)))  # no prefill instance: the decode prefills, and queues
    assert isinstance(local, Placement) and local.prefill_id is None
