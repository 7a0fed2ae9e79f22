"""The simulator and the real conductor place a request alike on the same state.

A small trace runs in the simulator to an instant when prefill queues, running decode batches,
incoming requests, local caches and the store are all non-empty. That state is then told to the
conductor's own :class:`services.conductor.view.GlobalView` the way the running system tells it:
registry records, one load report per instance, KV events of every cache and of the store, and the
conductor's pending placements for requests on their way to a decode instance. Both sides build a
``ClusterView`` (the simulator's ``Simulation.view``, the conductor's ``GlobalView.snapshot``) and
the same ``yutu.sched`` policy places probe requests on each: the placements must be equal.

Prefill reports name the requests they queue, as a real instance's do, so the conductor drops
exactly those pending placements. Two requests' KV has been on its way to their decode for a while
(132 and 157 ms, a slow network): the conductor keeps them until a decode report shows them
running, as the simulator lists them until their KV arrives.
"""

from __future__ import annotations

import pytest
from yutu.protocol.kv_events import BlockStored, KVEventBatch
from yutu.protocol.load import LoadReport
from yutu.registry import ServiceRecord
from yutu.sched import ClusterView, Placement, PrefixPlan, RequestView, policy_by_name
from yutu.sim.config import SimConfig
from yutu.sim.simulator import Simulation
from yutu.sim.trace import TraceRequest

from services.conductor.view import STORE, GlobalView
from tests.sim.sim_support import BS, req, tiny_profile

T = 2.07  # the snapshot instant: queues, batches and incoming requests everywhere


def scenario() -> Simulation:
    prof = tiny_profile(
        prefill=(0.0, 2.0**-5, 0.0), decode=(2.0**-4, 2.0**-8, 0.0), network_bps=2.0**11, max_batch=4
    )
    trace: list[TraceRequest] = []
    for i in range(24):
        shared = [1, 2, 3] if i % 2 == 0 else [50 + i % 4, 60 + i % 4]
        ids = shared + [1000 + i, 2000 + i, 3000 + i]
        trace.append(req(i, 0.1 * i, BS * len(ids) - 2, 6 + i % 7, ids))
    sim = Simulation(SimConfig(prefill=3, decode=2, policy="kvcentric", profile=prof), trace)
    sim.run(until=T)
    return sim


def conductor_view(sim: Simulation) -> GlobalView:
    """Tell a GlobalView the simulated state as records, reports, KV events and pending placements."""
    prof = sim.profile
    view = GlobalView(BS, report_stale_s=5.0)
    instances = [("prefill", p.instance_id) for p in sim.prefills] + [
        ("decode", d.instance_id) for d in sim.decodes
    ]
    meta = {"block_bytes": prof.bytes_per_block, "max_num_seqs": prof.max_batch}
    view.update_records([ServiceRecord(kind, iid, {}, meta, pid=1) for kind, iid in instances])
    # Placements whose KV has not reached the decode: the conductor counts them as pending.
    for rec in sim.records.values():
        if rec.decode_id is None or rec.rejected is not None:
            continue
        decodes = {d.instance_id: d for d in sim.decodes}
        if rec.index in decodes[rec.decode_id].incoming:
            assert rec.predicted_ttft_s is not None
            request = RequestView(f"r{rec.index}", (), rec.prompt_len, rec.output_len)
            ready = rec.arrival_s + rec.predicted_ttft_s
            placement = Placement(request.request_id, rec.prefill_id, rec.decode_id, PrefixPlan(0, 0, 1),
                                  rec.predicted_ttft_s, 0.0, ready, "kvcentric", "")  # fmt: skip
            view.note_placement(placement, request, rec.arrival_s)
            if rec.first_token_s is not None:  # the gateway saw the first token: the KV is on its way
                view.prefill_done(request.request_id, rec.first_token_s)
    snap = sim.view(T)
    for seq, p in enumerate(snap.prefills, 1):
        jobs = sim.prefills[seq - 1].queue
        rows = [[q.prompt_len, q.reused_tokens, q.computed_tokens, f"r{job.record.index}", q.priority, q.admitted]
                for q, job in zip(p.queue, jobs, strict=True)]  # fmt: skip
        view.on_report(_report(p.instance_id, "prefill", seq, p.free_blocks, queued=rows), T)
        cached = [int(k, 16) for k in sim.prefills[seq - 1].cache.keys()]
        view.on_kv_events(p.instance_id, KVEventBatch(T, [BlockStored(sorted(cached))]))
    for seq, d in enumerate(snap.decodes, 1):
        rows = [[r.kv_tokens, r.remaining_tokens] for r in d.running]
        view.on_report(_report(d.instance_id, "decode", seq, d.free_blocks, decoding=rows), T)
    view.on_kv_events(STORE, KVEventBatch(T, [BlockStored(sorted(int(k, 16) for k in sim.store.keys()))]))
    return view


def _report(iid: str, role: str, seq: int, free: int, **rows: object) -> LoadReport:
    return LoadReport(iid, role, seq, 1000.0 + seq, 0, 0, 0, free, 1000, BS, **rows)  # type: ignore[arg-type]


def _plain(view: ClusterView) -> tuple[object, ...]:
    """The view with its key sets as frozensets of the trace's keys (the simulator hands over its
    caches, the conductor its sets)."""
    keys = {format(h, "032x") for h in range(4000)}  # every hash id the scenario uses, and more
    prefills = tuple((p.instance_id, frozenset(k for k in keys if k in p.cached), p.free_blocks, p.queue)
                     for p in view.prefills)  # fmt: skip
    decodes = tuple((d.instance_id, d.free_blocks, d.max_batch, d.running, d.incoming) for d in view.decodes)
    return (
        prefills,
        decodes,
        frozenset(k for k in keys if k in view.store),
        view.bytes_per_block,
        view.block_size,
    )


@pytest.fixture(scope="module")
def both() -> tuple[Simulation, ClusterView, ClusterView]:
    sim = scenario()
    return sim, sim.view(T), conductor_view(sim).snapshot(T)


def test_the_scenario_has_every_kind_of_state(both: tuple[Simulation, ClusterView, ClusterView]) -> None:
    sim, ours, _ = both
    assert all(not d.waiting for d in sim.decodes)  # no KV caught between a step's start and end
    assert [len(p.queue) for p in ours.prefills] == [4, 3, 4]
    assert all(p.queue[0].computed_tokens > 0 for p in ours.prefills)  # each runs a half-done prompt
    assert all(p.queue[1].reused_tokens > 0 for p in ours.prefills)  # queued prompts with a planned prefix
    assert [len(d.running) for d in ours.decodes] == [1, 2]
    assert [len(d.incoming) for d in ours.decodes] == [8, 5]
    assert all(len(p.cache) > 0 for p in sim.prefills) and len(sim.store) > 0
    in_flight = sorted(
        round(T - r.first_token_s, 3)
        for d in sim.decodes
        for i in d.incoming
        if (r := sim.records[i]).first_token_s is not None
    )
    assert in_flight == [0.132, 0.157]  # handed over longer ago than the report lag


def test_both_views_hold_the_same_cluster(both: tuple[Simulation, ClusterView, ClusterView]) -> None:
    _, ours, theirs = both
    assert _plain(ours) == _plain(theirs)


@pytest.mark.parametrize("policy", ["kvcentric", "cache_aware", "least_loaded", "round_robin"])
def test_the_same_policy_places_alike_on_both(
    policy: str, both: tuple[Simulation, ClusterView, ClusterView]
) -> None:
    sim, ours, theirs = both
    probes = [
        req(900, T, BS * 6 - 1, 8, [1, 2, 3, 7000, 7001, 7002]),  # the hot shared prefix
        req(901, T, BS * 5 - 1, 8, [51, 61, 7100, 7101, 7102]),  # another family's prefix
        req(902, T, BS * 4 - 1, 8, [7200, 7201, 7202, 7203]),  # nothing cached anywhere
    ]
    sim_policy = policy_by_name(policy, costs=sim.profile.cost_models())
    conductor_policy = policy_by_name(policy, costs=sim.profile.cost_models())
    for probe in probes:
        request = RequestView(probe.request_id, probe.block_keys, probe.input_length, probe.output_length)
        a, b = sim_policy.place(ours, request, T), conductor_policy.place(theirs, request, T)
        assert isinstance(a, Placement) and a == b
