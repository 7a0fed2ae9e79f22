"""A failing step fails exactly its requests; the engine goes on serving (tiny real model, CPU).

Faults are injected by wrapping the real runner, scheduler and block manager of a real engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from yutu.engine.engine import NONFINITE_LOGITS, FinishReason, LLMEngine, RequestOutput
from yutu.engine.errors import EngineBrokenError
from yutu.engine.sampling import SamplingParams

from tests.engine.engine_support import make_engine, prompt

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


A, B, C, D = prompt(40, 1), prompt(40, 2), prompt(40, 3), prompt(40, 4)  # 2 full blocks of 16 each


def drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until idle, checking the pool after every step; outputs per request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.block_manager.check_integrity()
    assert not engine.has_unfinished_requests()
    return outputs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> dict[str, list[int]]:
    """Greedy tokens of each prompt run alone in a fresh engine."""
    ref = {}
    for name, ids in {"A": A, "B": B, "C": C, "D": D}.items():
        engine = make_engine(ckpt)
        engine.add_request(name, ids, GREEDY)
        ref[name] = tokens(drain(engine)[name])
    return ref


def fail_on_call(fn: Callable[..., Any], call: int, exc: Exception) -> Callable[..., Any]:
    """``fn``, except that its ``call``-th call (1-based) raises ``exc``."""
    count = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        if count == call:
            raise exc
        return fn(*args, **kwargs)

    return wrapper


def assert_failed(out: RequestOutput, needle: str) -> None:
    assert out.failed and out.error is not None and needle in out.error
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []


def test_model_fault_fails_the_step_requests_only(
    ckpt: Path, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(ckpt, max_num_seqs=2)  # A and B run together, C waits for a slot
    for name, ids in (("A", A), ("B", B), ("C", C)):
        engine.add_request(name, ids, GREEDY)
    first = engine.step()  # prefill of A and B: their first tokens
    assert [(o.request_id, o.new_token_ids) for o in first] == [
        ("A", reference["A"][:1]),
        ("B", reference["B"][:1]),
    ]
    fault = RuntimeError("injected model fault")
    monkeypatch.setattr(engine.runner, "run", fail_on_call(engine.runner.run, 1, fault))

    failed = engine.step()

    assert [o.request_id for o in failed] == ["A", "B"]
    for out in failed:
        assert_failed(out, "engine step failed: RuntimeError: injected model fault")
        assert out.num_prompt_tokens == 40
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0  # A and B freed; C not admitted yet
    assert (
        engine.consecutive_failed_steps == 1 and engine.last_failure == "RuntimeError: injected model fault"
    )
    rest = drain(engine)
    assert list(rest) == ["C"] and tokens(rest["C"]) == reference["C"]
    assert engine.consecutive_failed_steps == 0
    engine.add_request("D", D, GREEDY)
    assert tokens(drain(engine)["D"]) == reference["D"]
    stats = engine.stats()
    assert (stats.failed_steps_total, stats.failed_requests_total) == (1, 2)
    assert engine.block_manager.num_used_blocks == 0


def test_nonfinite_logits_fail_that_request_alone(
    ckpt: Path, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(ckpt)
    real_run = engine.runner.run
    calls = 0

    def nan_for_b_once(batch: Any, *args: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        logits = real_run(batch, *args).clone()  # an inference tensor: not writable in place
        if calls == 1:  # the prefill step: rows are A then B
            logits[1, 7] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "run", nan_for_b_once)
    engine.add_request("A", A, GREEDY)
    engine.add_request("B", B, GREEDY)
    outs = drain(engine)
    (b_out,) = outs["B"]
    assert_failed(b_out, NONFINITE_LOGITS)
    assert tokens(outs["A"]) == reference["A"]
    assert engine.stats().failed_requests_total == 1 and engine.stats().failed_steps_total == 0

    # B's blocks never reached the prefix cache (their KV is suspect); A's did.
    engine.add_request("A2", A, GREEDY)
    engine.add_request("B2", B, GREEDY)
    again = drain(engine)
    assert again["A2"][0].num_cached_tokens == 32 and tokens(again["A2"]) == reference["A"]
    assert again["B2"][0].num_cached_tokens == 0 and tokens(again["B2"]) == reference["B"]


def test_scheduler_fault_fails_running_keeps_waiting(
    ckpt: Path, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(ckpt, max_num_seqs=2)
    for name, ids in (("A", A), ("B", B), ("C", C)):
        engine.add_request(name, ids, GREEDY)
    engine.step()
    fault = AssertionError("injected scheduler bug")
    monkeypatch.setattr(engine.scheduler, "schedule", fail_on_call(engine.scheduler.schedule, 1, fault))

    failed = engine.step()

    assert sorted(o.request_id for o in failed) == ["A", "B"]
    for out in failed:
        assert_failed(out, "AssertionError: injected scheduler bug")
    engine.block_manager.check_integrity()
    rest = drain(engine)
    assert list(rest) == ["C"] and tokens(rest["C"]) == reference["C"]


def test_failed_steps_in_a_row_are_counted_and_reset(
    ckpt: Path, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(ckpt)
    real_run = engine.runner.run
    failing = True

    def run(batch: Any, *args: Any) -> torch.Tensor:
        if failing:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_run(batch, *args)

    monkeypatch.setattr(engine.runner, "run", run)
    for i in range(3):
        engine.add_request(f"r{i}", A, GREEDY)
        (out,) = engine.step()
        assert_failed(out, "illegal memory access")
        assert engine.consecutive_failed_steps == i + 1
    failing = False
    engine.add_request("ok", A, GREEDY)
    assert tokens(drain(engine)["ok"]) == reference["A"]
    assert engine.consecutive_failed_steps == 0


def test_step_raises_engine_broken_when_the_pool_is_inconsistent(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(ckpt)
    bm = engine.block_manager
    # The second block taken while admitting A fails: allocate() has already taken one, which no
    # table lists any more. Aborting A cannot give it back, so the engine cannot go on.
    monkeypatch.setattr(bm, "_take_free_block", fail_on_call(bm._take_free_block, 2, RuntimeError("bad")))
    engine.add_request("A", A, GREEDY)
    with pytest.raises(
        EngineBrokenError, match=r"KV block pool is inconsistent after a failed step: .*ref count 1"
    ):
        engine.step()
