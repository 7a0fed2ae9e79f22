"""The conductor's global view, fed by hand: records, load reports, KV events, pending placements."""

from __future__ import annotations

import pytest
from yutu.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from yutu.protocol.load import LoadReport
from yutu.registry import ServiceRecord
from yutu.sched import KVCentric, Placement, PrefixPlan, QueuedPrefill, RequestView

from services.conductor.view import STORE, GlobalView

BS = 16


def record(kind: str, instance_id: str, pid: int = 100, **meta: object) -> ServiceRecord:
    endpoints = {"load": f"tcp://127.0.0.1:1{pid}", "kv_events": f"tcp://127.0.0.1:2{pid}"}
    return ServiceRecord(
        kind, instance_id, endpoints, {"block_bytes": 4096, "max_num_seqs": 8, **meta}, pid=pid
    )


def report(instance_id: str, seq: int, role: str, **fields: object) -> LoadReport:
    base: dict[str, object] = dict(
        instance_id=instance_id, role=role, seq=seq, time=1000.0 + seq, num_running=0, num_waiting=0,
        num_held=0, free_blocks=100, total_blocks=128, block_size=BS,
    )  # fmt: skip
    base.update(fields)
    return LoadReport(**base)  # type: ignore[arg-type]


def key(i: int) -> str:
    return f"{i:032x}"


def test_instances_need_a_fresh_report_and_a_sane_record() -> None:
    view = GlobalView(BS, report_stale_s=5.0)
    joined, left = view.update_records(
        [record("prefill", "p0"), record("decode", "d0", pid=101), record("gateway", "g", pid=102)]
    )
    assert (sorted(joined), left) == (["d0", "p0"], [])
    assert view.live("prefill", now=10.0) == []  # no report yet
    assert view.on_report(report("p0", 1, "prefill"), now=10.0)
    assert not view.on_report(report("zz", 1, "prefill"), now=10.0)  # unknown instance
    assert [i.instance_id for i in view.live("prefill", now=14.9)] == ["p0"]
    assert view.live("prefill", now=15.1) == []  # stale
    view.update_records([record("prefill", "p0", broken="engine died"), record("decode", "d0", pid=101)])
    view.on_report(report("p0", 2, "prefill"), now=20.0)
    assert view.live("prefill", now=20.0) == []  # broken instances get nothing
    joined, left = view.update_records([record("prefill", "p0", pid=999)])  # restarted: a new incarnation
    assert (joined, left) == (["p0"], ["d0"])
    assert view.instances["p0"].report is None and view.bytes_per_block == 4096


def test_kv_events_track_each_cache_and_the_store() -> None:
    view = GlobalView(BS, report_stale_s=5.0)
    view.update_records([record("prefill", "p0")])
    view.on_kv_events("p0", KVEventBatch(0.0, [BlockStored([bytes.fromhex(key(1)), bytes.fromhex(key(2))])]))
    view.on_kv_events(STORE, KVEventBatch(0.0, [BlockStored([bytes.fromhex(key(1))]), BlockStored([3])]))
    assert view.instances["p0"].cached == {key(1), key(2)}
    assert view.store_keys == {key(1), key(3)}
    view.on_kv_events("p0", KVEventBatch(0.0, [BlockRemoved([bytes.fromhex(key(2))])]))
    assert view.instances["p0"].cached == {key(1)}
    view.on_kv_events("p0", KVEventBatch(0.0, [AllBlocksCleared(), BlockStored([bytes.fromhex(key(7))])]))
    assert view.instances["p0"].cached == {key(7)}
    view.on_kv_events("gone", KVEventBatch(0.0, [BlockStored([1])]))  # an instance that left: ignored
    view.reset_keys(STORE)
    assert view.store_keys == set()


def test_pending_placements_count_until_a_report_names_them() -> None:
    view = GlobalView(BS, report_stale_s=5.0)
    view.update_records([record("prefill", "p0"), record("decode", "d0", pid=101)])
    view.on_report(report("p0", 1, "prefill", queued=[[64, 16, 0, "r0"]]), now=10.0)
    view.on_report(report("d0", 1, "decode", decoding=[[80, 10]], free_blocks=50), now=10.0)
    request = RequestView("r1", (key(1), key(2)), 40, 8)
    placement = Placement("r1", "p0", "d0", PrefixPlan(1, 2, 8), 0.5, 0.01, 10.5, "kvcentric", "test")
    view.note_placement(placement, request, now=10.1)
    snap = view.snapshot(now=10.1)
    (p,) = snap.prefills
    assert [(q.prompt_len, q.reused_tokens) for q in p.queue] == [(64, 16), (40, 32)]
    assert p.free_blocks == 100 - 3  # ceil((40 + 8) / 16)
    (d,) = snap.decodes
    assert [(i.arrival_s, i.prompt_len) for i in d.incoming] == [(10.5, 40)]
    assert d.batch_size == 1 and d.kv_tokens == 80 and d.max_batch == 8
    view.prefill_done("someone-else", now=10.1)
    assert len(view.snapshot(now=10.1).prefills[0].queue) == 2
    # Reports made before the request reached the engine (a busy gateway or worker) do not name it,
    # however late they come: it still counts, once.
    view.on_report(report("p0", 2, "prefill"), now=10.12)
    view.on_report(report("p0", 3, "prefill", free_blocks=100), now=10.9)
    (p,) = view.snapshot(now=10.9).prefills
    assert [(q.prompt_len, q.reused_tokens) for q in p.queue] == [(40, 32)] and p.free_blocks == 97
    view.on_report(report("p0", 4, "prefill", queued=[[40, 32, 8, "r1"]], free_blocks=97), now=10.95)
    (p,) = view.snapshot(now=10.95).prefills  # named: the report counts it, the pending entry goes
    assert [(q.prompt_len, q.reused_tokens, q.computed_tokens) for q in p.queue] == [(40, 32, 8)]
    assert p.free_blocks == 97
    view.on_report(report("p0", 5, "prefill"), now=11.0)  # it ran and left the engine
    assert view.snapshot(now=11.0).prefills[0].queue == ()
    view.prefill_done("r1", now=10.12)  # the gateway's word of its first token (the decode side below)
    view.on_report(report("d0", 2, "decode", decoding=[[80, 10]]), now=10.15)  # not running there yet
    (incoming,) = view.snapshot(now=10.15).decodes[0].incoming
    assert (incoming.arrival_s, incoming.prompt_len) == (10.12, 40)  # it joins from its first token on
    # Its KV still on the way 180 ms after the first token: the report does not list it, the view does.
    view.on_report(report("d0", 3, "decode", decoding=[[80, 10]]), now=10.3)
    assert len(view.snapshot(now=10.3).decodes[0].incoming) == 1
    # Running: prompt + its first token, 7 of its 8 tokens left (signature 40 + 8).
    view.on_report(report("d0", 4, "decode", decoding=[[80, 10], [41, 7]]), now=10.4)
    assert view.snapshot(now=10.4).decodes[0].incoming == ()
    assert view.snapshot(now=10.6, exclude=frozenset({"d0"})).decodes == ()


def test_a_first_token_ends_a_pending_prefill_no_report_named() -> None:
    view = GlobalView(BS, report_stale_s=5.0)
    view.update_records([record("prefill", "p0"), record("decode", "d0", pid=101)])
    view.on_report(report("p0", 1, "prefill"), now=10.0)
    view.on_report(report("d0", 1, "decode"), now=10.0)
    placement = Placement("r1", "p0", "d0", PrefixPlan(0, 0, 40), 0.1, 0.01, 10.2, "kvcentric", "test")
    view.note_placement(placement, RequestView("r1", (), 40, 8), now=10.1)
    view.on_report(report("p0", 2, "prefill", queued=[[64, 0, 0, "other"], [9, 0, 0, ["junk"]]]), now=10.2)
    assert len(view.snapshot(now=10.2).prefills[0].queue) == 3  # two rows, and r1 still pending
    view.prefill_done("r1", now=10.3)  # it ran between two reports: none ever named it
    assert [q.prompt_len for q in view.snapshot(now=10.3).prefills[0].queue] == [64, 9]


def test_a_policy_places_on_the_snapshot() -> None:
    view = GlobalView(BS, report_stale_s=5.0)
    view.update_records(
        [record("prefill", "p0"), record("prefill", "p1", pid=102), record("decode", "d0", pid=101)]
    )
    for name in ("p0", "p1"):
        view.on_report(report(name, 1, "prefill"), now=1.0)
    view.on_report(report("d0", 1, "decode"), now=1.0)
    keys = tuple(key(i) for i in range(8))
    view.on_kv_events("p1", KVEventBatch(0.0, [BlockStored([bytes.fromhex(k) for k in keys])]))
    outcome = KVCentric().place(view.snapshot(now=1.0), RequestView("r", keys, 8 * BS + 5, 4), now=1.0)
    assert isinstance(outcome, Placement)
    assert (outcome.prefill_id, outcome.decode_id, outcome.plan.local_blocks) == ("p1", "d0", 8)


def decode_view(**kw: object) -> GlobalView:
    view = GlobalView(BS, report_stale_s=5.0, **kw)  # type: ignore[arg-type]
    view.update_records([record("decode", "d0", pid=101)])
    return view


def place_on_d0(
    view: GlobalView, rid: str, now: float, prefill: str | None = "p0", ready: float = 1.5
) -> None:
    request = RequestView(rid, (), 40, 8)
    plan = PrefixPlan(0, 0, 40)
    view.note_placement(Placement(rid, prefill, "d0", plan, 0.4, 0.01, ready, "p", "t"), request, now=now)


def incoming(view: GlobalView, now: float) -> list[float]:
    return [i.arrival_s for i in view.snapshot(now=now).decodes[0].incoming]


def test_a_prefill_running_late_still_counts_on_its_decode() -> None:
    view = decode_view()
    view.on_report(report("d0", 1, "decode"), now=1.0)
    place_on_d0(view, "r9", now=1.1, prefill=None)  # the decode prefills it itself
    view.on_report(report("d0", 2, "decode"), now=1.3)  # nobody said its first token came
    assert incoming(view, 1.3) == [1.5]
    view.on_report(report("d0", 3, "decode", queued=[[40, 0, 16]]), now=1.6)  # past its predicted end
    assert incoming(view, 1.6) == [1.6]  # still coming: it cannot join before its prefill ends
    view.on_report(report("d0", 4, "decode"), now=31.0)
    assert incoming(view, 31.0) == [31.0]
    assert incoming(view, 31.1) == []  # no first token within pending_ttl_s of the placement: given up


def test_a_sequence_of_the_same_shape_already_running_does_not_show_a_handed_over_request() -> None:
    view = decode_view()
    view.on_report(report("d0", 1, "decode", decoding=[[44, 4]]), now=1.0)  # another 40 + 8 sequence
    place_on_d0(view, "r1", now=1.1)
    view.prefill_done("r1", now=1.5)
    view.on_report(report("d0", 2, "decode", decoding=[[45, 3]]), now=1.7)  # the other one, a step on
    assert incoming(view, 1.7) == [1.5]
    view.on_report(report("d0", 3, "decode", decoding=[]), now=1.9)  # it left; ours not yet there
    assert incoming(view, 1.9) == [1.5]
    view.on_report(report("d0", 4, "decode", decoding=[[41, 7]]), now=2.1)  # ours
    assert incoming(view, 2.1) == []


def test_requests_of_one_signature_are_shown_oldest_first() -> None:
    view = decode_view()
    view.on_report(report("d0", 1, "decode"), now=1.0)
    place_on_d0(view, "r1", now=1.1)
    place_on_d0(view, "r2", now=1.2)
    view.prefill_done("r2", now=1.4)
    view.prefill_done("r1", now=1.5)
    view.on_report(report("d0", 2, "decode", decoding=[[41, 7]]), now=1.6)  # one of them runs
    assert incoming(view, 1.6) == [1.5]  # r2, handed over first, is the one shown
    view.on_report(report("d0", 3, "decode", decoding=[[42, 6]]), now=1.8)  # still only one
    assert incoming(view, 1.8) == [1.5]
    view.on_report(report("d0", 4, "decode", decoding=[[43, 5], [41, 7]]), now=2.0)
    assert incoming(view, 2.0) == []


def test_a_handed_over_request_no_report_shows_is_dropped_after_handoff_ttl() -> None:
    view = decode_view(handoff_ttl_s=2.0)
    view.on_report(report("d0", 1, "decode"), now=1.0)
    place_on_d0(view, "r1", now=1.1)
    view.prefill_done("r1", now=1.5)  # e.g. its first token was its last: it never runs there
    view.on_report(report("d0", 2, "decode"), now=3.4)
    assert incoming(view, 3.4) == [1.5]
    assert incoming(view, 3.5) == []


def test_a_request_that_ended_counts_nowhere_at_once() -> None:
    view = decode_view(handoff_ttl_s=10.0)
    view.update_records([record("prefill", "p0", pid=100), record("decode", "d0", pid=101)])
    view.on_report(report("d0", 1, "decode"), now=1.0)
    view.on_report(report("p0", 1, "prefill"), now=1.0)
    place_on_d0(view, "r1", now=1.1)
    place_on_d0(view, "r2", now=1.2)
    assert [len(i.pending) for i in (view.instances["p0"], view.instances["d0"])] == [2, 2]
    view.prefill_done("r1", now=1.5)
    view.request_done("r1")  # it ended between two reports: no report will ever show it
    assert incoming(view, 1.6) == [1.6]  # only r2 counts on d0 (its predicted prefill end passed: now)
    view.request_done("r2")  # ended before its first token (aborted, failed)
    assert incoming(view, 1.7) == []
    assert [len(i.pending) for i in (view.instances["p0"], view.instances["d0"])] == [0, 0]
    view.request_done("unknown")  # a request it never placed (the gateway placed it itself): nothing


def test_a_placement_again_replaces_the_first() -> None:
    view = decode_view()
    view.on_report(report("d0", 1, "decode"), now=1.0)
    place_on_d0(view, "r1", now=1.1, ready=1.5)
    place_on_d0(view, "r1", now=1.3, ready=2.5)  # its prefill instance failed: placed again
    assert incoming(view, 1.3) == [2.5]


def test_a_decode_lists_the_prefills_it_took_on_until_their_first_token() -> None:
    view = decode_view()
    view.on_report(report("d0", 1, "decode"), now=1.0)
    place_on_d0(view, "r1", now=1.1, prefill=None)  # the decode prefills r1 itself
    place_on_d0(view, "r2", now=1.2)  # r2 comes through a prefill instance: not the decode's work
    assert view.snapshot(now=1.2).decodes[0].prefills == (QueuedPrefill(40),)
    # Its report shows r1's progress; it also lists r2 (handed over, loading its KV): not a prefill of d0.
    rows = [[40, 0, 16, "r1"], [40, 0, 0, "r2"]]
    view.on_report(report("d0", 2, "decode", queued=rows), now=1.3)
    assert view.snapshot(now=1.3).decodes[0].prefills == (QueuedPrefill(40, 0, 16),)
    view.prefill_done("r1", now=1.4)
    assert view.snapshot(now=1.4).decodes[0].prefills == ()
    assert len(view.snapshot(now=1.4).decodes[0].incoming) == 2  # both still join its batch


def test_the_decode_prefill_chunk_comes_from_its_record() -> None:
    view = GlobalView(BS, report_stale_s=5.0)
    view.update_records([record("decode", "d0", max_num_batched_tokens=512), record("decode", "d1", pid=101)])
    view.on_report(report("d0", 1, "decode"), now=1.0)
    view.on_report(report("d1", 1, "decode"), now=1.0)
    assert [d.chunk_tokens for d in view.snapshot(now=1.0).decodes] == [512, None]


def test_the_ttft_correction_tracks_measured_over_predicted_and_never_loosens() -> None:
    from services.conductor.correction import MAX_FACTOR, TTFTCorrection

    c = TTFTCorrection(alpha=0.5)
    assert c.factor == 1.0
    c.observe(0.1, 0.4)  # 4x slower than predicted
    # halfway there in log space (2x), times the deviation from what was expected (halfway too: 2x)
    assert c.factor == pytest.approx(4.0)
    for _ in range(20):
        c.observe(0.1, 0.4)
    assert c.factor == pytest.approx(4.0, rel=1e-3)  # steady: the deviation has died away
    for _ in range(40):
        c.observe(0.1, 0.01)  # faster than predicted: the SLO is never loosened
    assert c.factor == 1.0
    for _ in range(40):
        c.observe(0.1, 1000.0)
    assert c.factor == pytest.approx(MAX_FACTOR)
    c.observe(0.0, 1.0)  # a zero prediction carries no information
    assert c.samples == 101


def test_the_ttft_correction_keeps_a_margin_for_scattered_ratios() -> None:
    from services.conductor.correction import TTFTCorrection

    steady, scattered = TTFTCorrection(alpha=0.2), TTFTCorrection(alpha=0.2)
    for i in range(200):
        steady.observe(0.1, 0.12)  # always 1.2x
        scattered.observe(0.1, 0.12 * (1.25 if i % 2 else 0.8))  # 1.2x on average (in log space), +-25%
    assert steady.factor == pytest.approx(1.2, rel=1e-3)
    # the margin is about the typical deviation, log(1.25) = 0.22 on either side of log(1.2) (the
    # smoothed mean itself still sways with the last samples, hence the range)
    assert 1.2 * 1.2 < scattered.factor < 1.2 * 1.35


def test_queued_prompts_keep_their_priority_and_whether_the_engine_admitted_them() -> None:
    view = GlobalView(BS, report_stale_s=5.0)
    view.update_records([record("prefill", "p0"), record("decode", "d0", pid=101)])
    rows = [[64, 16, 8, "a", 3, True], [32, 0, 0, "b", -2, False], [16, 0, 0, "c", "junk", "yes"]]
    view.on_report(report("p0", 1, "prefill", queued=rows), now=10.0)
    view.on_report(report("d0", 1, "decode"), now=10.0)
    request = RequestView("r1", (key(1),), 40, 8, priority=7)
    placement = Placement("r1", "p0", "d0", PrefixPlan(0, 0, 40), 0.5, 0.01, 10.5, "kvcentric", "test")
    view.note_placement(placement, request, now=10.1)
    (p,) = view.snapshot(now=10.1).prefills
    assert [(q.prompt_len, q.priority, q.admitted) for q in p.queue] == [
        (64, 3, True),
        (32, -2, False),
        (16, 0, False),  # a malformed priority or flag reads as the defaults
        (40, 7, False),  # the placement itself, until a report names it: waiting, at its priority
    ]
