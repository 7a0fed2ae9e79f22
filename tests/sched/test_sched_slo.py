"""Early rejection: TTFT and TBT SLOs, TBT judged on the load forecast for the prefill's end."""

from __future__ import annotations

import pytest
from yutu.errors import ErrorKind
from yutu.sched import (
    POLICIES,
    ClusterView,
    IncomingDecode,
    Placement,
    QueuedPrefill,
    RejectCause,
    Rejection,
    RequestView,
    RunningDecode,
    policy_by_name,
)

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

ALL = sorted(POLICIES)


def place(name: str, view: ClusterView, **options: object) -> Placement | Rejection:
    return policy_by_name(name, costs=costs(), **options).place(view, request(), 0.0)


def test_ttft_above_the_slo_is_rejected_with_the_queue_drain_as_retry() -> None:
    view = cluster((prefill("p0", queue=(QueuedPrefill(10240),)),), (decode("d0"),))  # 10 s queued
    ttft = 10.0 + prefill_time(PROMPT)
    out = place("kvcentric", view, slo_ttft_s=1.0)
    assert isinstance(out, Rejection)
    assert out.cause is RejectCause.TTFT_SLO
    assert out.error_kind is ErrorKind.OVERLOADED
    assert out.ttft_s == ttft
    assert out.tbt_s == step(1)
    assert out.retry_after_s == ttft - 1.0
    assert out.reason.startswith(
        "kvcentric: predicted TTFT 10.157s > SLO 1.000s on the best placement (prefill p0"
    )


def test_what_a_request_waited_before_placement_counts_in_its_ttft() -> None:
    view = cluster((prefill("p0"),), (decode("d0"),))
    policy = policy_by_name("kvcentric", costs=costs(), slo_ttft_s=1.0)
    fresh = policy.place(view, request(), 0.0)
    assert isinstance(fresh, Placement) and fresh.ttft_s == prefill_time(PROMPT) == fresh.ready_at_s
    waited = RequestView("r1", request().block_keys, PROMPT, 8, waited_s=0.5)
    out = policy.place(view, waited, 0.0)
    assert isinstance(out, Placement)
    assert out.ttft_s == 0.5 + prefill_time(PROMPT)  # the client counts the wait
    assert out.ready_at_s == prefill_time(PROMPT)  # the decode still gets it when the prefill ends
    assert "0.500s waited before placement" in out.reason
    late = RequestView("r1", request().block_keys, PROMPT, 8, waited_s=0.9)
    rejected = policy.place(view, late, 0.0)
    assert isinstance(rejected, Rejection) and rejected.cause is RejectCause.TTFT_SLO
    assert rejected.reason.startswith("kvcentric: predicted TTFT 1.057s > SLO 1.000s")
    with pytest.raises(ValueError, match="waited_s"):
        RequestView("r1", (), PROMPT, 8, waited_s=-1.0)


def test_ttft_met_exactly_is_accepted() -> None:
    out = place("kvcentric", cluster((prefill("p0"),), (decode("d0"),)), slo_ttft_s=prefill_time(PROMPT))
    assert isinstance(out, Placement)


def test_a_prompt_that_alone_misses_the_ttft_slo_retries_late() -> None:
    out = place("kvcentric", cluster((prefill("p0"),), (decode("d0"),)), slo_ttft_s=0.1)
    assert isinstance(out, Rejection)
    assert out.cause is RejectCause.TTFT_SLO
    assert out.retry_after_s == 30.0


@pytest.mark.parametrize("name", ALL)
def test_rejected_on_todays_load_but_accepted_on_the_load_at_prefill_end(name: str) -> None:
    # Today: 5 sequences, so this request would make 6 (> SLO of 2). Each has 1 token left and
    # leaves after one step, long before the prefill ends at 161/1024 s: the request runs alone.
    d0 = decode("d0", running=tuple(RunningDecode(100, 1) for _ in range(5)))
    out = place(name, cluster((prefill("p0"),), (d0,)), slo_tbt_s=step(2))
    assert isinstance(out, Placement), out
    assert out.tbt_s == step(1)


@pytest.mark.parametrize("name", ALL)
def test_accepted_on_todays_load_but_rejected_on_the_load_at_prefill_end(name: str) -> None:
    # Today: idle. But 4 requests placed earlier finish their prefills at 1/16 s and join after their
    # handoff (7 blocks: transfer_time(7) = 1/16 s), before this one (161/1024 s + transfer_time(11)),
    # and stay for 1000 steps: the request would make a batch of 5.
    arriving = tuple(IncomingDecode(arrival_s=2.0**-4, prompt_len=100, max_tokens=1001) for _ in range(4))
    d0 = decode("d0", incoming=arriving)
    out = place(name, cluster((prefill("p0"),), (d0,)), slo_tbt_s=step(2))
    assert isinstance(out, Rejection), out
    assert out.cause is RejectCause.TBT_SLO
    assert out.tbt_s == step(5)
    assert out.ttft_s == prefill_time(PROMPT)
    # At the step of that batch, step(5), they leave at 1/8 + 1000 * step(5) s; sent that much later,
    # the request would join an empty batch.
    joins = prefill_time(PROMPT) + transfer_time(11)
    assert out.retry_after_s == 2.0**-3 + 1000 * step(5) - joins
    assert out.reason == (
        f"{name}: predicted TBT {step(5):.4f}s > SLO {step(2):.4f}s on decode d0 at batch 5, the heaviest "
        "forecast while it decodes"
    )


def place_long(view: ClusterView, max_tokens: int, **options: object) -> Placement | Rejection:
    return policy_by_name("kvcentric", costs=costs(), **options).place(
        view, request(max_tokens=max_tokens), 0.0
    )


@pytest.mark.parametrize(("arrival", "accepted"), [(1.0, False), (20.0, True)])
def test_tbt_is_judged_on_the_heaviest_batch_of_the_decode_lifetime(arrival: float, accepted: bool) -> None:
    # Idle when this request joins (161/1024 s + its handoff), but 4 requests placed earlier end
    # their prefills at ``arrival`` and stay. The request decodes 999 tokens at step(1) s (~8.8 s):
    # arriving at 1 s they join its batch (5 sequences, TBT step(5) > SLO step(2)); arriving at
    # 20 s it has long left.
    later = tuple(IncomingDecode(arrival_s=arrival, prompt_len=100, max_tokens=1001) for _ in range(4))
    out = place_long(cluster((prefill("p0"),), (decode("d0", incoming=later),)), 1000, slo_tbt_s=step(2))
    if accepted:
        assert isinstance(out, Placement), out
        assert out.tbt_s == step(1)
        return
    assert isinstance(out, Rejection), out
    assert out.cause is RejectCause.TBT_SLO
    assert out.tbt_s == step(5)
    # At step(5) the 4 leave at 1 + transfer_time(7) + 1000 * step(5) s; joining then, it runs alone.
    joins = prefill_time(PROMPT) + transfer_time(11)
    assert out.retry_after_s == 1.0 + transfer_time(7) + 1000 * step(5) - joins


def test_the_lifetime_forecast_prefers_the_decode_nobody_will_join() -> None:
    # Both idle at the prefill's end; d0 gets 2 committed requests 1 s later, d1 none.
    later = tuple(IncomingDecode(arrival_s=1.0, prompt_len=100, max_tokens=1001) for _ in range(2))
    view = cluster((prefill("p0"),), (decode("d0", incoming=later), decode("d1")))
    out = place_long(view, 1000)
    assert isinstance(out, Placement)
    assert (out.decode_id, out.tbt_s) == ("d1", step(1))


def test_tbt_slo_no_load_can_meet_retries_late() -> None:
    out = place("kvcentric", cluster((prefill("p0"),), (decode("d0"),)), slo_tbt_s=step(1) / 2)
    assert isinstance(out, Rejection)
    assert out.cause is RejectCause.TBT_SLO
    assert out.retry_after_s == 30.0


def test_kvcentric_picks_the_decode_that_meets_the_slo() -> None:
    crowded = decode("d0", running=tuple(RunningDecode(100, 1000) for _ in range(3)))
    quiet = decode("d1", running=(RunningDecode(100, 1000),))
    out = place("kvcentric", cluster((prefill("p0"),), (crowded, quiet)), slo_tbt_s=step(2))
    assert isinstance(out, Placement)
    assert out.decode_id == "d1"
    assert out.tbt_s == step(2)


def test_no_early_rejection_before_the_models_are_calibrated() -> None:
    """A prior describes no real machine: until measured, requests are placed, not turned away."""
    from yutu.sched import CostModels, DecodeCostModel, KVCentric, PolicyOptions, PrefillCostModel

    from tests.sched.sched_support import cluster, decode, prefill, request

    guess = CostModels(prefill=PrefillCostModel((10.0, 0.0, 0.0)), decode=DecodeCostModel((10.0, 0.0, 0.0)))
    policy = KVCentric(PolicyOptions(slo_ttft_s=0.5, slo_tbt_s=0.1), guess)
    view = cluster([prefill("p0")], [decode("d0")])
    assert not guess.prefill.calibrated and not guess.decode.calibrated
    placed = policy.place(view, request(), now=0.0)
    assert placed.__class__.__name__ == "Placement"  # predicted 10 s on an uncalibrated guess
    for i in range(8):  # measurements that agree with the guess: now it is believed
        guess.prefill.observe(64 + i, 0, 10.0)
        guess.decode.observe(1 + i, 100, 10.0)
    assert guess.prefill.calibrated and guess.decode.calibrated
    rejected = policy.place(view, request(), now=0.0)
    assert rejected.__class__.__name__ == "Rejection"


def test_only_the_prompts_served_before_a_request_count_in_its_ttft() -> None:
    """The engines serve by priority (a lower value first), then first come first served, and finish
    the prompts they admitted before any waiting one starts: a request's predicted queue is the
    admitted prompts and the waiting ones of its priority or a lower value."""
    queue = (
        QueuedPrefill(4096, priority=5, admitted=True, computed_tokens=1024),  # 3 s left, running
        QueuedPrefill(2048, priority=0),  # 2 s waiting
        QueuedPrefill(1024, priority=-1),  # 1 s waiting
        QueuedPrefill(8192, priority=3),  # 8 s waiting
    )
    view = cluster((prefill("p0", queue=queue),), (decode("d0"),))
    policy = policy_by_name("kvcentric", costs=costs(), slo_ttft_s=8.0)
    expected = {-2: 3.0, -1: 4.0, 0: 6.0, 2: 6.0, 3: 14.0, 9: 14.0}
    for priority, queued in expected.items():
        req = RequestView("r1", request().block_keys, PROMPT, 8, priority=priority)
        out = policy.place(view, req, 0.0)
        assert out.ttft_s == queued + prefill_time(PROMPT), priority
        # The SLO admits what the engines serve in time and rejects what would wait behind 14 s.
        assert isinstance(out, Placement) if priority < 3 else isinstance(out, Rejection), priority
    with pytest.raises(ValueError, match="priority"):
        RequestView("r1", (), PROMPT, 8, priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority"):
        QueuedPrefill(10, priority=True)


def test_a_decode_prefilling_itself_counts_only_the_prefills_ahead_of_the_request() -> None:
    """Without a prefill instance the decode instance prefills: its own queued prompts count as a
    prefill instance's do, by priority."""
    d0 = decode("d0", prefills=(QueuedPrefill(2048, priority=0), QueuedPrefill(1024, priority=-1)))
    view = cluster((), (d0,))
    policy = policy_by_name("kvcentric", costs=costs())
    for priority, queued in ((-5, 0.0), (-1, 1.0), (0, 3.0)):
        req = RequestView("r1", request().block_keys, PROMPT, 8, priority=priority)
        out = policy.place(view, req, 0.0)
        assert isinstance(out, Placement) and out.prefill_id is None
        assert out.ttft_s == queued + prefill_time(PROMPT), priority
