"""Wide steps (a long prompt's chunk) on up to ``prefill_threads`` -- the CPUs free when they start
(yutu.engine.cpus) -- the others on the process's threads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from yutu.engine.cpus import WideStepThreads
from yutu.engine.engine import (
    WIDE_STEP_SPAN,
    WIDE_STEP_TOKENS,
    EngineConfig,
    LLMEngine,
    is_wide,
    torch_threads,
)
from yutu.engine.sampling import SamplingParams
from yutu.engine.scheduler import ScheduledBatch, ScheduledChunk

from tests.engine.engine_support import make_engine, prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
LONG = {"max_model_len": 512, "max_num_batched_tokens": 512}  # room for prompts past a wide step


def _record_threads(engine: LLMEngine) -> list[tuple[int, int]]:
    """(tokens, torch threads) of every forward pass from now on."""
    seen: list[tuple[int, int]] = []
    run = engine.runner.run

    def recording(batch, *args):  # type: ignore[no-untyped-def]
        seen.append((batch.num_tokens, torch.get_num_threads()))
        return run(batch, *args)

    engine.runner.run = recording  # type: ignore[method-assign]
    return seen


def _on_idle_cpus(engine: LLMEngine, cpus: int = 2) -> LLMEngine:
    """``engine`` as on a host of ``cpus`` CPUs where nothing else runs (whatever this one runs)."""
    assert engine.wide_step_threads is not None
    engine.wide_step_threads = WideStepThreads(engine.wide_step_threads.most, cpus, busy=lambda: 0)
    return engine


def _run(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    out: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in prompts}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs or ())
    return out


def test_wide_steps_run_on_the_prefill_threads_and_the_others_on_the_process_threads(ckpt: Path) -> None:
    assert torch.get_num_threads() == 1  # the module's fixture
    engine = make_engine(ckpt, prefill_threads=2, **{**LONG, "max_num_batched_tokens": WIDE_STEP_TOKENS})
    _on_idle_cpus(engine)
    seen = _record_threads(engine)
    _run(engine, {"long": prompt(WIDE_STEP_TOKENS + 40, seed=1), "short": prompt(20, seed=2)})
    assert torch.get_num_threads() == 1  # put back after every wide step
    wide = [threads for tokens, threads in seen if tokens >= WIDE_STEP_TOKENS]
    narrow = [threads for tokens, threads in seen if tokens < WIDE_STEP_TOKENS]
    assert wide == [2]  # the long prompt's first chunk (the whole budget)
    assert narrow and set(narrow) == {1}  # its second chunk, the short prompt, every decode
    assert engine.last_wide_threads == 2


@pytest.mark.parametrize(("busy", "threads"), [(0, 3), (1, 3), (2, 2), (3, 1), (7, 1)])
def test_a_wide_step_takes_only_the_cpus_no_other_engine_computes_on(
    ckpt: Path, busy: int, threads: int
) -> None:
    """On 4 CPUs where other engines run ``busy`` threads: 4 - busy, within [1, prefill_threads=3]."""
    engine = make_engine(ckpt, prefill_threads=3, **{**LONG, "max_num_batched_tokens": WIDE_STEP_TOKENS})
    engine.wide_step_threads = WideStepThreads(3, cpus=4, busy=lambda: busy)
    seen = _record_threads(engine)
    _run(engine, {"long": prompt(WIDE_STEP_TOKENS + 8, seed=4)})
    assert [t for tokens, t in seen if tokens >= WIDE_STEP_TOKENS] == [threads]
    assert {t for tokens, t in seen if tokens < WIDE_STEP_TOKENS} == {1}


def _chunk(n: int, start: int) -> ScheduledChunk:
    return ScheduledChunk("s", [1] * n, start, [], sample=True)


def test_a_step_is_wide_by_its_tokens_or_by_the_span_its_prompt_chunks_attend() -> None:
    assert is_wide(ScheduledBatch([_chunk(WIDE_STEP_TOKENS, 0)]))  # a fresh prompt's chunk
    assert not is_wide(ScheduledBatch([_chunk(128, 0)]))
    assert is_wide(ScheduledBatch([_chunk(64, 960)]))  # 64 tokens after a 960-token cached prefix
    assert not is_wide(ScheduledBatch([_chunk(32, 992)]))  # 32 x 1024 < WIDE_STEP_SPAN
    decodes = [_chunk(1, 4000) for _ in range(60)]  # decodes never count, however long their context
    assert 60 * 4001 > WIDE_STEP_SPAN and not is_wide(ScheduledBatch(decodes))


def test_a_short_chunk_after_a_long_cached_prefix_runs_wide(ckpt: Path) -> None:
    engine = _on_idle_cpus(make_engine(ckpt, prefill_threads=2, **LONG))
    prefix = prompt(400, seed=5)
    _run(engine, {"first": prefix + [7]})
    seen = _record_threads(engine)
    _run(engine, {"again": prefix + prompt(100, seed=6)})  # 400 cached + 100 new: 100 x 500 > the span
    assert seen[0] == (100, 2)
    assert {threads for _, threads in seen[1:]} == {1}  # its decodes


def test_without_prefill_threads_every_step_keeps_the_process_threads(ckpt: Path) -> None:
    engine = make_engine(ckpt, **LONG)
    seen = _record_threads(engine)
    _run(engine, {"long": prompt(WIDE_STEP_TOKENS + 50, seed=3)})
    assert any(tokens >= WIDE_STEP_TOKENS for tokens, _ in seen)
    assert {threads for _, threads in seen} == {1}


def test_output_is_the_same_on_prefill_threads(ckpt: Path) -> None:
    prompts = {f"p{i}": prompt(n, seed=10 + i) for i, n in enumerate((WIDE_STEP_TOKENS + 60, 150, 30))}
    one = _run(make_engine(ckpt, **LONG), prompts)
    engine = _on_idle_cpus(make_engine(ckpt, prefill_threads=2, **LONG))
    seen = _record_threads(engine)
    two = _run(engine, prompts)
    assert (sum(len(ids) for ids in prompts.values()), 2) in seen  # the prompts' step ran on two
    for rid in prompts:
        assert two[rid][0] == one[rid][0]  # greedy tokens equal (float32)
        assert two[rid][1] == pytest.approx(one[rid][1], abs=1e-4)


def test_torch_threads_goes_back_even_when_the_block_raises() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        raise RuntimeError("the step failed")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1])
def test_prefill_threads_must_be_positive(ckpt: Path, bad: int) -> None:
    with pytest.raises(ValueError, match="prefill_threads"):
        EngineConfig(model_dir=ckpt, prefill_threads=bad)
