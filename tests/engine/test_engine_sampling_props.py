"""Property: any sampling parameters the API accepts run to the end on a real engine.

Parameters are built the way the gateway builds them (the request schema, ``max_tokens_for``, then
``services.gateway.prompts.sampling_for``, and so ``SamplingParams``' own validation): either that raises a ValueError or an ApiError with a message, or a real
:class:`LLMEngine` over the tiny model runs the request to its end with valid tokens and finite
logprobs. The strategies lean on the edges of float32 and int64 (subnormal and tiny top_p, tiny and
huge temperatures, huge top_k, seeds and stop ids; penalties and logit biases at and past their
bounds, repetition penalties near 0 and huge), where the sampler used to meet NaN and kill the
engine thread. Afterwards the engine still serves a greedy request with its usual tokens.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yutu.engine.engine import EngineConfig, FinishReason, LLMEngine, RequestOutput
from yutu.engine.sampling import SamplingParams
from yutu.engine.testing import make_tiny_checkpoint

from services.gateway.errors import ApiError
from services.gateway.prompts import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    logit_bias_for,
    max_tokens_for,
    sampling_for,
)
from services.gateway.schemas import CompletionRequest

VOCAB = 512
MAX_MODEL_LEN = 48
GREEDY_PROMPT = [5, 9, 23, 42, 7, 7, 81, 3, 64, 11, 2, 19, 33, 48, 90, 101, 17, 4]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

F32_EDGES = [0.0, 5e-324, 1e-50, 2.0**-150, 2.0**-149, 1e-45, 1e-40, 1.1754943e-38, 1e-6, 1e-5, 9.99e-6]
floats = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)
int64_edges = st.sampled_from([-(2**63) - 1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70])


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama", arch="llama", seed=0)
    config = EngineConfig(
        model_dir=ckpt, device="cpu", num_kv_blocks=16, block_size=16, max_model_len=MAX_MODEL_LEN
    )
    return LLMEngine(config)


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(request_id, prompt, params)
    outputs: list[RequestOutput] = []
    for _ in range(MAX_MODEL_LEN + 1):
        if not engine.has_unfinished_requests():
            break
        outputs += engine.step()
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    return outputs


def check_ran_to_the_end(engine: LLMEngine, outputs: list[RequestOutput], params: SamplingParams) -> None:
    assert outputs, "the request produced nothing"
    assert not any(out.failed for out in outputs), [out.error for out in outputs]
    tokens = [t for out in outputs for t in out.new_token_ids]
    assert all(type(t) is int and 0 <= t < VOCAB for t in tokens), tokens
    assert 1 <= len(tokens) <= params.max_tokens
    assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
    last = outputs[-1]
    if last.finish_reason is FinishReason.LENGTH:
        assert len(tokens) == params.max_tokens or last.num_prompt_tokens + len(tokens) == MAX_MODEL_LEN
    else:
        assert last.finish_reason is FinishReason.STOP
        assert len(tokens) >= params.min_tokens  # no eos or stop token before min_tokens were out
        eos = () if params.ignore_eos else engine.model_config.eos_token_ids
        assert tokens[-1] in params.stop_token_ids or tokens[-1] in eos
    if params.logprobs is None:
        assert all(out.new_logprobs is None for out in outputs)
        return
    entries = [lp for out in outputs for lp in out.new_logprobs or []]
    assert [lp.token_id for lp in entries] == tokens
    for lp in entries:
        assert math.isfinite(lp.logprob) and lp.logprob <= 0.0
        assert len(lp.top) == params.logprobs
        values = [v for _, v in lp.top]
        assert all(math.isfinite(v) for v in values) and values == sorted(values, reverse=True)
        assert all(0 <= t < VOCAB for t, _ in lp.top)


request_fields = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.one_of(
            st.floats(0, 2), st.sampled_from(F32_EDGES + [0.5, 1.0, 2.0]), floats, st.integers(-1, 3)
        ),
        "top_p": st.one_of(st.floats(0, 1), st.sampled_from(F32_EDGES + [0.5, 1.0 - 1e-9, 1.0]), floats),
        "top_k": st.one_of(st.integers(-3, VOCAB + 3), st.integers(-(2**70), 2**70), int64_edges),
        "seed": st.one_of(st.integers(-(2**65), 2**65), int64_edges),
        "logprobs": st.integers(-1, 21),
        "max_tokens": st.one_of(st.integers(-1, 8), st.integers(MAX_MODEL_LEN - 14, MAX_MODEL_LEN + 2)),
        "stop_token_ids": st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, 2**65)), max_size=4),
        "ignore_eos": st.booleans(),
        "echo": st.booleans(),  # with logprobs: the prompt's logprobs too
        "min_tokens": st.integers(-1, 10),
        "presence_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2.0, 2.0, -2.0001, 2.5]), floats),
        "frequency_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2.0, 2.0, 2.0001]), floats),
        "repetition_penalty": st.one_of(
            st.floats(0.5, 2), st.sampled_from(F32_EDGES + [1.0, 1e30, 3.4e38, 1e39]), floats
        ),
        "logit_bias": st.dictionaries(
            st.one_of(
                st.integers(-2, VOCAB + 2).map(str), st.sampled_from(["", "x", "1.0", "+3", "007", "7"])
            ),
            st.one_of(st.floats(-100, 100), st.sampled_from([-100.0, 100.0, 100.5]), floats),
            max_size=4,
        ),
    },
)


def test_accepted_sampling_params_always_run_to_the_end(engine: LLMEngine) -> None:
    usual = [t for out in run(engine, "greedy-before", GREEDY_PROMPT, GREEDY) for t in out.new_token_ids]
    assert len(usual) == 8
    ids = itertools.count()
    outcomes = {"rejected": 0, "ran": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(fields=request_fields, prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    def accepted_requests_run(fields: dict[str, Any], prompt: list[int]) -> None:
        try:
            req = CompletionRequest(model="tiny", prompt=prompt, **fields)
            max_tokens = max_tokens_for(
                len(prompt), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_MODEL_LEN
            )
            params = sampling_for(req, max_tokens, req.logprobs, 0, logit_bias_for(req.logit_bias, VOCAB))
        except (ValueError, ApiError) as exc:  # pydantic's ValidationError is a ValueError
            assert str(exc).strip(), f"{type(exc).__name__} without a message"
            outcomes["rejected"] += 1
            return
        outputs = run(engine, f"r{next(ids)}", prompt, params)
        check_ran_to_the_end(engine, outputs, params)
        outcomes["ran"] += 1

    accepted_requests_run()

    assert outcomes["ran"] > 0 and outcomes["rejected"] > 0, outcomes
    again = [t for out in run(engine, "greedy-after", GREEDY_PROMPT, GREEDY) for t in out.new_token_ids]
    assert again == usual
