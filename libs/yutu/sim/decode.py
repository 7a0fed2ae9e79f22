"""A simulated decode instance: continuous batching, one token per running sequence per step.

Steps run back to back while anything is running; step ``i`` (1-based) ends at ``step_ends[i-1]``
and lasts ``profile.step_s(batch, kv_tokens)`` at the batch it started with. A sequence joins at a
step boundary (``join_step`` = steps completed then) and emits its tokens at the ends of steps
``join_step+1 .. end_step`` (``end_step = join_step + output_len - 1``; the prefill emitted the first).
Its token gaps are ``step_ends[join_step] - first_token`` (the handoff: the KV transfer and any
wait for a batch slot) and then the step durations (the TBT's input).

A request placed here is *incoming* until its KV arrives (``arrive``), then *waiting* until the
batch and the KV blocks have room (reserved at the join for its prompt and all its output tokens),
then running. An incoming request joins, as the conductor forecasts it, at its predicted prefill
end (or now, once that has passed) until its first token is out (``handed``), then from that token.
``local`` jobs (the decode prefilling a request itself: no prefill instance had room, or conditional
disaggregation) ride the next step, which then lasts their prefill time plus the decode step.

``view`` is what a conductor would see: running sequences with their KV and remaining tokens,
incoming placements (waiting ones as arriving now), and the blocks not reserved.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from yutu.sched import DecodeView, IncomingDecode, QueuedPrefill, RunningDecode
from yutu.sched.prefix import cdiv
from yutu.sim.profile import Profile
from yutu.sim.record import RequestRecord

FOREVER = 1 << 40  # tokens: a running sequence whose end a view must not forecast


@dataclass(slots=True)
class Sequence:
    record: RequestRecord
    blocks: int
    kv_join: int = 0
    join_step: int = 0
    end_step: int = 0


@dataclass(slots=True)
class LocalJob:
    record: RequestRecord
    seconds: float  # its prefill (and fetch) time
    reused_tokens: int = 0  # prompt tokens fetched from the store, not computed


class DecodeInstance:
    def __init__(self, instance_id: str, profile: Profile) -> None:
        self.instance_id = instance_id
        self.profile = profile
        self.running: dict[int, Sequence] = {}
        self._ends: list[tuple[int, int]] = []  # heap of (end_step, request index)
        self.waiting: deque[Sequence] = deque()
        self.incoming: dict[int, IncomingDecode] = {}
        self._handed: set[int] = set()  # incoming requests whose first token is out
        self.local: deque[LocalJob] = deque()
        self._riding: list[LocalJob] = []  # local jobs in the step running now
        self.step = 0  # steps completed
        self.step_ends: list[float] = []
        self.stepping = False
        self.measured: tuple[int, int, float] | None = None  # (batch, kv, s) of a pure decode step running
        self.kv_tokens = 0  # of the running sequences
        self.reserved_blocks = 0  # of the running sequences
        self.busy_s = 0.0

    def blocks_for(self, record: RequestRecord) -> int:
        return cdiv(record.prompt_len + record.output_len, self.profile.block_size)

    # -- arrivals ---------------------------------------------------------------------------------

    def expect(self, record: RequestRecord, ready_at: float) -> None:
        """A placement names this instance: list it as incoming until its KV arrives."""
        self.incoming[record.index] = IncomingDecode(ready_at, record.prompt_len, record.output_len)

    def handed(self, record: RequestRecord, now: float) -> None:
        """Its prefill ended at ``now`` (the conductor hears of the first token): it joins from then."""
        inc = self.incoming.get(record.index)
        if inc is not None:
            self.incoming[record.index] = IncomingDecode(now, inc.prompt_len, inc.max_tokens)
            self._handed.add(record.index)

    def forget(self, record: RequestRecord) -> None:
        """It will not come (refused when its KV arrived)."""
        self.incoming.pop(record.index, None)
        self._handed.discard(record.index)

    def fits(self, seq: Sequence) -> bool:
        room = self.profile.decode_kv_blocks - self.reserved_blocks
        # An empty instance takes any one sequence: one larger than all its KV must still run.
        return not self.running or (len(self.running) < self.profile.max_batch and seq.blocks <= room)

    def arrive(self, record: RequestRecord) -> Sequence:
        """The request's KV is here: it waits for the next step boundary with room."""
        self.forget(record)
        seq = Sequence(record, self.blocks_for(record))
        self.waiting.append(seq)
        return seq

    def add_local(self, job: LocalJob) -> None:
        self.forget(job.record)
        self.local.append(job)

    # -- steps ------------------------------------------------------------------------------------

    def _join(self, seq: Sequence) -> list[RequestRecord]:
        """``seq`` joins at this boundary; returns it when it has no token left to decode."""
        r = seq.record
        seq.kv_join, seq.join_step, seq.end_step = r.prompt_len, self.step, self.step + r.output_len - 1
        if r.output_len == 1:  # the prefill's token was its only one
            assert r.first_token_s is not None
            r.finish(r.first_token_s, [])
            return [r]
        self.running[r.index] = seq
        self.reserved_blocks += seq.blocks
        self.kv_tokens += r.prompt_len
        heapq.heappush(self._ends, (seq.end_step, r.index))
        return []

    def admit(self) -> list[RequestRecord]:
        """Join the waiting sequences that fit (FIFO; the first that does not fit blocks the rest)."""
        done: list[RequestRecord] = []
        while self.waiting:
            seq = self.waiting[0]
            if not self.fits(seq):
                break
            self.waiting.popleft()
            done += self._join(seq)
        return done

    def start_step(self, now: float, slowdown: float = 1.0) -> float | None:
        """Start a step at ``now`` if there is work; returns its end time (None: idle)."""
        if self.stepping:
            return None
        self._riding = list(self.local)
        self.local.clear()
        if not self.running and not self._riding:
            return None
        seconds = sum(j.seconds for j in self._riding)
        self.measured = None
        if self.running:
            step = self.profile.step_s(len(self.running), self.kv_tokens) * slowdown
            seconds += step
            if not self._riding:  # what a worker reports: decode-only steps
                self.measured = (len(self.running), self.kv_tokens, step)
        self.stepping = True
        self.busy_s += seconds
        return now + seconds

    def end_step(self, now: float) -> list[RequestRecord]:
        """The step ended at ``now``: every running sequence emitted a token; returns the finished."""
        self.stepping = False
        self.step += 1
        self.step_ends.append(now)
        self.kv_tokens += len(self.running)
        finished: list[RequestRecord] = []
        while self._ends and self._ends[0][0] <= self.step:
            _, index = heapq.heappop(self._ends)
            seq = self.running.pop(index)
            self.kv_tokens -= seq.kv_join + (self.step - seq.join_step)
            self.reserved_blocks -= seq.blocks
            finished.append(self._finish(seq))
        for job in self._riding:  # their first token is out; they decode from the next step
            job.record.first_token_s = now
            self.waiting.appendleft(Sequence(job.record, self.blocks_for(job.record)))
        self._riding = []
        return finished

    def _finish(self, seq: Sequence) -> RequestRecord:
        r = seq.record
        assert r.first_token_s is not None
        ends = self.step_ends[seq.join_step : seq.end_step]  # ends of steps join+1 .. end
        gaps = [ends[0] - r.first_token_s] + [b - a for a, b in zip(ends, ends[1:], strict=False)]
        r.finish(ends[-1], gaps)
        return r

    # -- the conductor's view -----------------------------------------------------------------------

    def view(self, now: float, forecast: bool = True, blocks: bool = True) -> DecodeView:
        """The instance as a load report shows it. ``forecast=False`` hides when sequences will leave
        and lists every incoming request as arrived: a policy then judges the load of this instant
        (the "early rejection without prediction" baseline). ``blocks=False`` reports every KV block
        free: the policy does not turn requests away for decode memory (the "rejection after
        prefill" baseline, where the decode instance checks when the KV arrives)."""
        running = tuple(
            RunningDecode(
                s.kv_join + self.step - s.join_step, s.end_step - self.step if forecast else FOREVER
            )
            for s in self.running.values()
        )
        incoming = [
            i if index in self._handed else IncomingDecode(max(i.arrival_s, now), i.prompt_len, i.max_tokens)
            for index, i in self.incoming.items()
        ]
        incoming += [IncomingDecode(now, s.record.prompt_len, s.record.output_len) for s in self.waiting]
        incoming += [IncomingDecode(now, j.record.prompt_len, j.record.output_len) for j in self.local]
        if not forecast:
            incoming = [IncomingDecode(now, i.prompt_len, FOREVER) for i in incoming]
        free = max(0, self.profile.decode_kv_blocks - (self.reserved_blocks if blocks else 0))
        prefills = tuple(
            QueuedPrefill(j.record.prompt_len, min(j.reused_tokens, j.record.prompt_len - 1))
            for j in (*self._riding, *self.local)
        )
        return DecodeView(
            self.instance_id, free, self.profile.max_batch, running, tuple(incoming), prefills=prefills
        )
