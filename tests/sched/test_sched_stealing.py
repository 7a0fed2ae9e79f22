"""Prefill stealing: a decode instance takes a prefill off a prefill instance's queue when that pays
(``yutu.sched.placer``, step 5). Exact placements on scripted views (costs in sched_support)."""

from __future__ import annotations

import pytest
from yutu.sched import (
    POLICIES,
    ClusterView,
    Placement,
    PrefixPlan,
    QueuedPrefill,
    Rejection,
    RunningDecode,
    policy_by_name,
)

from tests.sched.sched_support import PROMPT, cluster, costs, decode, prefill, prefill_time, request, step

ALL = sorted(POLICIES)
BUSY = (RunningDecode(50, 1000), RunningDecode(50, 1000))  # two sequences decoding for a long while


def place(name: str, view: ClusterView, **options: object) -> Placement | Rejection:
    return policy_by_name(name, costs=costs(), **{"prefill_stealing": True, **options}).place(
        view, request(), 0.0
    )


def queued(tokens: int) -> tuple[QueuedPrefill, ...]:
    """A queue of ``tokens / 1024`` seconds of prefill work."""
    return (QueuedPrefill(tokens),)


@pytest.mark.parametrize("name", ALL)
def test_an_idle_decode_takes_a_prefill_off_a_queue(name: str) -> None:
    out = place(name, cluster((prefill("p0", queue=queued(1000)),), (decode("d0"),)))
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id, out.local_prefill) == (None, "d0", True)
    assert out.plan == PrefixPlan(local_blocks=0, fetch_end=0, compute_tokens=PROMPT)
    assert out.ttft_s == prefill_time(PROMPT)  # instead of prefill_time(1000 + PROMPT) on p0
    assert out.tbt_s == step(1)
    assert "stolen from the queue of prefill p0 (ttft 1.134s there; queue 0.977s)" in out.reason


@pytest.mark.parametrize("name", ALL)
def test_without_a_queue_the_prefill_instance_keeps_it(name: str) -> None:
    # Both would take prefill_time(PROMPT): a tie stays disaggregated.
    out = place(name, cluster((prefill("p0"),), (decode("d0"),)))
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id) == ("p0", "d0")


def test_stealing_off_leaves_the_queue_its_work() -> None:
    out = place(
        "kvcentric", cluster((prefill("p0", queue=queued(1000)),), (decode("d0"),)), prefill_stealing=False
    )
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id) == ("p0", "d0")
    assert out.ttft_s == prefill_time(1000 + PROMPT)


@pytest.mark.parametrize(("queue", "stolen"), [(334, True), (332, False)])
def test_a_busy_decode_steals_only_when_the_time_saved_exceeds_the_delay_it_adds(
    queue: int, stolen: bool
) -> None:
    # Locally the prompt waits for the running step (step(2) = 10/1024 s) and its prefill (161/1024 s)
    # delays both running sequences: it pays when queue/1024 - 10/1024 > 2 * 161/1024, queue > 332.
    out = place("kvcentric", cluster((prefill("p0", queue=queued(queue)),), (decode("d0", running=BUSY),)))
    assert isinstance(out, Placement)
    assert out.prefill_id == (None if stolen else "p0")
    assert out.ttft_s == (step(2) + prefill_time(PROMPT) if stolen else prefill_time(queue + PROMPT))


def test_under_a_tbt_slo_the_stall_must_fit_it() -> None:
    # Unchunked, the whole prefill rides one step: step(2) + 161/1024 s > 0.1 s, however long the queue.
    view = cluster((prefill("p0", queue=queued(10240)),), (decode("d0", running=BUSY),))
    out = place("kvcentric", view, slo_tbt_s=0.1)
    assert isinstance(out, Placement)
    assert out.prefill_id == "p0"
    # Chunked by 16 tokens, the dearest step is step(2) + 16/1024 s <= 0.1 s: stolen.
    view = cluster((prefill("p0", queue=queued(10240)),), (decode("d0", running=BUSY, chunk_tokens=16),))
    out = place("kvcentric", view, slo_tbt_s=0.1)
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.ttft_s) == (None, step(2) + prefill_time(PROMPT))


def test_the_prefills_a_decode_took_on_are_its_queue() -> None:
    # d0 already prefills 1000 tokens: locally 1161/1024 s, on p0 661/1024 s.
    view = cluster((prefill("p0", queue=queued(500)),), (decode("d0", prefills=queued(1000)),))
    out = place("kvcentric", view)
    assert isinstance(out, Placement)
    assert out.prefill_id == "p0"
    # 100 tokens there: locally 261/1024 s.
    view = cluster((prefill("p0", queue=queued(500)),), (decode("d0", prefills=queued(100)),))
    out = place("kvcentric", view)
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.ttft_s) == (None, prefill_time(100 + PROMPT))


def test_a_decode_without_blocks_for_the_prompt_does_not_steal() -> None:
    # 11 blocks for the prompt and its first token; d0 has 10 free: it decodes the request once blocks
    # free (no SLO: nothing is turned away), but does not take its prefill now.
    out = place("kvcentric", cluster((prefill("p0", queue=queued(1000)),), (decode("d0", free=10),)))
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id) == ("p0", "d0")


def test_stealing_is_an_option_off_by_default_and_validated() -> None:
    assert policy_by_name("kvcentric").options.prefill_stealing is False
    with pytest.raises(ValueError, match="prefill_stealing must be True or False"):
        policy_by_name("kvcentric", prefill_stealing="yes")
