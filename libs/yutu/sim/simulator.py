"""The discrete-event loop: a trace through N prefill and M decode instances, placed by a
``yutu.sched`` policy exactly as the conductor places them.

    ARRIVAL    build the ClusterView from the instances' state -> policy.place(view, request, now)
               -> a Rejection, or a job queued on the prefill instance (or riding a decode's step)
    PREFILL    a prefill ends: first token; blocks enter the local cache and the store; the KV
               goes to the decode instance (handoff = the prompt's KV bytes over the network)
    KV         the KV arrived: the request waits for the decode's next step boundary with room
    STEP       a decode step ended: a token for every running sequence; the finished leave
    SAMPLE     the load timeline and the replica counts of the hottest blocks

Events are ordered by (time, insertion order): the same config and trace give the same run.
Randomness (only with ``jitter > 0``) comes from one ``random.Random(seed)``.

The policy gets the profile as trusted cost models (a calibrated conductor) and views with no report
lag: the simulator measures what the conductor's view would hold at best. With ``learn_costs`` it
starts from the conductor's own untrusted priors instead (no early rejection until they are
calibrated) and its models are fed what a conductor gets in load reports: every prefill's
``(prompt, reused, seconds)``, every store read's ``(bytes, seconds)``, every decode-only step's
``(batch, kv_tokens, seconds)``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from yutu.sched import ClusterView, CostModels, Placement, RequestView, policy_by_name
from yutu.sched.estimate import prefill_blocks
from yutu.sim.cache import BlockCache
from yutu.sim.config import Rejection, SimConfig
from yutu.sim.decode import DecodeInstance, LocalJob
from yutu.sim.prefill import PrefillInstance, PrefillJob
from yutu.sim.record import RequestRecord
from yutu.sim.trace import TraceRequest

ARRIVAL, PREFILL, KV, STEP, SAMPLE = range(5)
HOT_RANKS = (1, 10, 100, 1000)  # replica counts of the blocks ranked here by accesses in the trace
DECODE_REFUSED = "decode_tbt"  # the after-prefill baseline's rejection cause

Progress = Callable[[int, int], None]


@dataclass
class Timeline:
    """Load over time: one row per ``sample_s``, replica counts per ``replica_sample_s``."""

    t: list[float] = field(default_factory=list)
    prefill_queued_tokens: list[int] = field(default_factory=list)  # tokens left to compute, all instances
    prefill_queue: list[int] = field(default_factory=list)  # prompts queued or running
    decode_running: list[int] = field(default_factory=list)
    decode_waiting: list[int] = field(default_factory=list)
    replica_t: list[float] = field(default_factory=list)
    replicas: dict[int, list[int]] = field(default_factory=dict)  # rank -> prefill caches holding it


class Simulation:
    def __init__(self, config: SimConfig, requests: list[TraceRequest]) -> None:
        self.config = config
        self.requests = requests
        prof = config.profile
        self.profile = prof
        self.store = BlockCache(config.eviction_policy, config.store_capacity_blocks)
        self.prefills = [
            PrefillInstance(
                f"prefill-{i:02d}", prof, BlockCache(config.eviction_policy, config.local_cache_blocks)
            )
            for i in range(config.prefill)
        ]
        self.decodes = [DecodeInstance(f"decode-{i:02d}", prof) for i in range(config.decode)]
        self._prefill_at = {p.instance_id: i for i, p in enumerate(self.prefills)}
        self._decode_at = {d.instance_id: i for i, d in enumerate(self.decodes)}
        options = dataclasses.asdict(config.policy_options())
        self.costs = CostModels() if config.learn_costs else prof.cost_models()
        self.policy = policy_by_name(config.policy, costs=self.costs, **options)
        self.records = {
            r.index: RequestRecord(r.index, r.arrival_s, r.input_length, r.output_length) for r in requests
        }
        self.timeline = Timeline(replicas={rank: [] for rank in HOT_RANKS})
        self._hot = hot_keys(requests, HOT_RANKS)
        self._events: list[tuple[float, int, int, int]] = []  # (time, order, kind, payload)
        self._order = 0
        self._rng = random.Random(config.seed)
        self.wasted_prefill_s = 0.0  # prefill compute of requests refused after it
        self.events = 0
        self._started = False
        self._arrived = 0
        self._next_replicas = 0.0

    def _push(self, at: float, kind: int, payload: int = 0) -> None:
        heapq.heappush(self._events, (at, self._order, kind, payload))
        self._order += 1

    def _slowdown(self) -> float:
        j = self.config.jitter
        return 1.0 if j == 0 else math.exp(self._rng.gauss(0.0, j))

    def run(self, progress: Progress | None = None, until: float | None = None) -> dict[int, RequestRecord]:
        """Run to the end (every request finished or rejected), or only through the events at or
        before ``until`` (a later call goes on from there); returns the records by index."""
        if not self._started:
            self._started = True
            for r in self.requests:
                self._push(r.arrival_s, ARRIVAL, r.index)
            self._push(self.requests[0].arrival_s, SAMPLE)
            self._next_replicas = self.requests[0].arrival_s
        by_index = {r.index: r for r in self.requests}
        total = len(self.requests)
        every = max(1, total // 100)
        while self._events and (until is None or self._events[0][0] <= until):
            now, _, kind, payload = heapq.heappop(self._events)
            self.events += 1
            if kind == ARRIVAL:
                self._arrive(now, by_index[payload])
                self._arrived += 1
                if progress is not None and (self._arrived % every == 0 or self._arrived == total):
                    progress(self._arrived, total)
            elif kind == PREFILL:
                self._prefill_done(now, self.prefills[payload])
            elif kind == KV:
                self._kv_arrived(now, self.records[payload])
            elif kind == STEP:
                self._step_done(now, self.decodes[payload], payload)
            elif self._events:  # SAMPLE, while anything else is still to happen
                self._sample(now)
                if now >= self._next_replicas:
                    self._sample_replicas(now)
                    self._next_replicas = now + self.config.replica_sample_s
                self._push(now + self.config.sample_s, SAMPLE)
        return self.records

    # -- handlers -----------------------------------------------------------------------------------

    def view(self, now: float) -> ClusterView:
        """The ClusterView the policy places on at ``now``: the instances as their load reports and
        KV events would show them to the conductor, with no report lag."""
        forecast = self.config.rejection is not Rejection.EARLY
        blocks = self.config.rejection is not Rejection.AFTER_PREFILL
        return ClusterView(
            tuple(p.view(now) for p in self.prefills),
            tuple(d.view(now, forecast, blocks) for d in self.decodes),
            self.store,
            self.profile.bytes_per_block,
            self.profile.block_size,
        )

    def _arrive(self, now: float, req: TraceRequest) -> None:
        record = self.records[req.index]
        request = RequestView(req.request_id, req.block_keys, req.input_length, req.output_length)
        outcome = self.policy.place(self.view(now), request, now)
        if not isinstance(outcome, Placement):
            record.rejected = str(outcome.cause)
            return
        record.prefill_id, record.decode_id = outcome.prefill_id, outcome.decode_id
        record.predicted_ttft_s = outcome.ttft_s
        d = self._decode_at[outcome.decode_id]
        decode = self.decodes[d]
        if outcome.prefill_id is None:
            self._local_prefill(now, req, record, outcome, d)
            return
        p = self._prefill_at[outcome.prefill_id]
        prefill = self.prefills[p]
        blocks = prefill_blocks(request, outcome.plan, self.profile.block_size)
        prefill.enqueue(PrefillJob(req, record, outcome.plan, d, blocks, now))
        decode.expect(record, outcome.ready_at_s)
        job = prefill.start(now, self.store, self._slowdown())
        if job is not None:
            self._push(job.ends_at, PREFILL, p)

    def _local_prefill(
        self, now: float, req: TraceRequest, record: RequestRecord, placement: Placement, d: int
    ) -> None:
        """The decode instance prefills the request in its next step (the plan re-checked now; its
        blocks enter the store at once, a simplification for a path the paper's setup never takes)."""
        plan, bs, prof = placement.plan, self.profile.block_size, self.profile
        end = self.store.prefix_hits(req.block_keys, plan.fetch_end) if plan.fetch_blocks else 0
        self.store.touch(req.block_keys[:end])
        record.fetched_blocks = end
        record.transfer_s = prof.transfer_s(end * prof.bytes_per_block)
        record.prefill_s = prof.prefill_s(req.input_length, end * bs) * self._slowdown()
        self.store.admit(req.block_keys)
        decode = self.decodes[d]
        decode.add_local(LocalJob(record, record.transfer_s + record.prefill_s, end * bs))
        end_at = decode.start_step(now, self._slowdown())
        if end_at is not None:
            self._push(end_at, STEP, d)

    def _prefill_done(self, now: float, prefill: PrefillInstance) -> None:
        job = prefill.finish(now, self.store)
        if self.config.learn_costs:
            r = job.record
            self.costs.prefill.observe(r.prompt_len, job.reused_tokens, r.prefill_s)
            if r.fetched_blocks:
                self.costs.transfer.observe(r.fetched_blocks * self.profile.bytes_per_block, r.transfer_s)
        self.decodes[job.decode_index].handed(job.record, now)
        handoff = self.profile.transfer_s(job.request.input_length * self.profile.kv_bytes_per_token)
        self._push(now + handoff, KV, job.record.index)
        nxt = prefill.start(now, self.store, self._slowdown())
        if nxt is not None:
            self._push(nxt.ends_at, PREFILL, self._prefill_at[prefill.instance_id])

    def _kv_arrived(self, now: float, record: RequestRecord) -> None:
        assert record.decode_id is not None
        d = self._decode_at[record.decode_id]
        decode = self.decodes[d]
        if self.config.rejection is Rejection.AFTER_PREFILL and self._refuses(decode, record):
            decode.forget(record)
            record.rejected = DECODE_REFUSED
            self.wasted_prefill_s += record.prefill_s + record.transfer_s
            return
        decode.arrive(record)
        if not decode.stepping:
            self._step_done(now, decode, d, step_ended=False)

    def _refuses(self, decode: DecodeInstance, record: RequestRecord) -> bool:
        """The after-prefill baseline: no room now (batch or KV blocks, counting those already
        waiting), or a step with it over the TBT SLO."""
        waiting = decode.waiting
        batch = len(decode.running) + len(waiting) + 1
        blocks = decode.reserved_blocks + sum(s.blocks for s in waiting) + decode.blocks_for(record)
        if batch > self.profile.max_batch or blocks > self.profile.decode_kv_blocks:
            return True
        slo = self.config.slo_tbt_s
        kv = decode.kv_tokens + sum(s.record.prompt_len for s in waiting) + record.prompt_len
        return slo is not None and self.profile.step_s(batch, kv) > slo

    def _step_done(self, now: float, decode: DecodeInstance, d: int, step_ended: bool = True) -> None:
        if step_ended:
            if self.config.learn_costs and decode.measured is not None:
                self.costs.decode.observe(*decode.measured)
            decode.end_step(now)
        decode.admit()
        end_at = decode.start_step(now, self._slowdown())
        if end_at is not None:
            self._push(end_at, STEP, d)

    # -- samples ------------------------------------------------------------------------------------

    def _sample(self, now: float) -> None:
        tl = self.timeline
        tl.t.append(now)
        tl.prefill_queued_tokens.append(
            sum(q.prompt_len - q.done_tokens for p in self.prefills for q in p.view(now).queue)
        )
        tl.prefill_queue.append(sum(len(p.queue) for p in self.prefills))
        tl.decode_running.append(sum(len(d.running) for d in self.decodes))
        tl.decode_waiting.append(sum(len(d.waiting) for d in self.decodes))

    def _sample_replicas(self, now: float) -> None:
        self.timeline.replica_t.append(now)
        for rank, key in self._hot.items():
            self.timeline.replicas[rank].append(sum(1 for p in self.prefills if key in p.cache))


def hot_keys(requests: list[TraceRequest], ranks: tuple[int, ...]) -> dict[int, str]:
    """The block keys ranked ``ranks`` (1 = most used) by how many requests use them; ties by key order
    of first use. Ranks beyond the trace's distinct blocks are left out."""
    counts: Counter[str] = Counter()
    for r in requests:
        counts.update(r.block_keys)
    ranked = counts.most_common()
    return {rank: ranked[rank - 1][0] for rank in ranks if rank <= len(ranked)}
