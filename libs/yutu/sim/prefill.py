"""A simulated prefill instance: a FIFO of prompts run one at a time, and a local prefix cache.

A job's run, once it reaches the head of the queue (``start``)::

    [ fetch blocks [local, fetch_end) from the store ][ compute tokens [fetch_end * bs, L) ]
      transfer_s = latency + bytes / bandwidth          prefill_s = profile.prefill_s(L, fetch_end * bs)

The prefix is matched again at the start, as an engine matches its prefix cache when it schedules a
prompt: the local cache's run of the prompt's blocks *now* (blocks cached since the placement count,
evicted ones do not), then the store's blocks up to the plan's ``fetch_end`` (the placement decided
whether the fetch pays; blocks the store lost since are computed). At the end (``finish``) the prompt's full blocks
enter the local cache and the store (write-behind), and its first token is out.

``view`` is what a conductor would see from this instance's load report, exactly (no report lag):
its queue with each prompt's reused and computed tokens, and the KV blocks its queue leaves free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from yutu.sched import PrefillView, PrefixPlan, QueuedPrefill
from yutu.sched.prefix import usable_blocks
from yutu.sim.cache import BlockCache
from yutu.sim.profile import Profile
from yutu.sim.record import RequestRecord
from yutu.sim.trace import TraceRequest


@dataclass(slots=True)
class PrefillJob:
    request: TraceRequest
    record: RequestRecord
    plan: PrefixPlan
    decode_index: int  # the decode instance that takes it after the prefill
    blocks: int  # KV blocks it holds here from placement to handoff
    queued_at: float
    started_at: float = 0.0
    ends_at: float = 0.0
    reused_tokens: int = 0  # as run (the plan re-checked at the start)


class PrefillInstance:
    def __init__(self, instance_id: str, profile: Profile, cache: BlockCache) -> None:
        self.instance_id = instance_id
        self.profile = profile
        self.cache = cache
        self.queue: deque[PrefillJob] = deque()  # the head is running when ``running`` is set
        self.running: PrefillJob | None = None
        self.used_blocks = 0
        self.busy_s = 0.0  # compute and fetch time spent

    @property
    def idle(self) -> bool:
        return self.running is None

    def enqueue(self, job: PrefillJob) -> None:
        self.queue.append(job)
        self.used_blocks += job.blocks

    def start(self, now: float, store: BlockCache, slowdown: float = 1.0) -> PrefillJob | None:
        """Start the next queued job at ``now`` (None when there is none); sets its end time."""
        if self.running is not None or not self.queue:
            return None
        job = self.queue[0]
        bs, keys, plan = self.profile.block_size, job.request.block_keys, job.plan
        length = job.request.input_length
        local = self.cache.prefix_hits(keys, usable_blocks(length, bs, len(keys)))
        end = local + store.prefix_hits(keys[local : plan.fetch_end]) if plan.fetch_end > local else local
        self.cache.touch(keys[:local])
        store.touch(keys[local:end])
        job.reused_tokens = end * bs
        r = job.record
        r.local_blocks, r.fetched_blocks = local, end - local
        r.queue_s = now - job.queued_at
        r.transfer_s = self.profile.transfer_s((end - local) * self.profile.bytes_per_block)
        r.prefill_s = self.profile.prefill_s(length, job.reused_tokens) * slowdown
        job.started_at, job.ends_at = now, now + r.transfer_s + r.prefill_s
        self.running = job
        return job

    def finish(self, now: float, store: BlockCache) -> PrefillJob:
        """The running job's prefill ended at ``now``: its blocks are cached here and in the store."""
        job = self.running
        assert job is not None and self.queue[0] is job
        self.queue.popleft()
        self.running = None
        self.used_blocks -= job.blocks
        self.busy_s += job.ends_at - job.started_at
        self.cache.admit(job.request.block_keys)
        store.admit(job.request.block_keys)
        job.record.first_token_s = now
        return job

    def view(self, now: float) -> PrefillView:
        queue = [self._queued(job, now) for job in self.queue]
        free = max(0, self.profile.prefill_kv_blocks - self.used_blocks)
        return PrefillView(self.instance_id, self.cache, free, tuple(queue))

    def _queued(self, job: PrefillJob, now: float) -> QueuedPrefill:
        length = job.request.input_length
        if job is not self.running:
            reused = job.plan.fetch_end * self.profile.block_size
            return QueuedPrefill(length, min(reused, length - 1))
        # Running: the share of its compute done so far, as chunked prefill would report it.
        compute_start = job.started_at + job.record.transfer_s
        todo = length - job.reused_tokens
        done = 0
        if now > compute_start and job.record.prefill_s > 0:
            done = min(todo - 1, int(todo * (now - compute_start) / job.record.prefill_s))
        return QueuedPrefill(length, job.reused_tokens, max(0, done), admitted=True)
