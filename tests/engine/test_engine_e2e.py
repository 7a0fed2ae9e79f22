"""LLMEngine end to end on a tiny random Llama checkpoint (CPU, float32).

References: transformers' generate() for greedy decoding, and the engine itself running each request
alone for batching, chunked prefill, prefix caching and preemption.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from yutu.engine.engine import EngineConfig, FinishReason, LLMEngine, RequestOutput
from yutu.engine.errors import InvalidRequestError, PromptTooLongError
from yutu.engine.sampling import SamplingParams
from yutu.engine.structured import grammar_from
from yutu.engine.testing import make_tiny_checkpoint

from tests.engine.engine_support import make_engine, prompt


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    """Add every request, step to completion checking the pool after each step; outputs per request."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine.block_manager.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_integrity()
    return outputs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def run_alone(ckpt: Path, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Each request in its own fresh engine: the reference for batching tests."""
    return {rid: tokens(run(make_engine(ckpt), {rid: req})[rid]) for rid, req in requests.items()}


@pytest.mark.parametrize(
    ("arch", "prompt_len", "overrides"),
    [
        ("llama", 5, {}),
        ("llama", 37, {}),
        ("qwen2", 37, {}),
        ("qwen3", 37, {"head_dim": 32}),
        ("qwen3_moe", 37, {"mlp_only_layers": [1]}),
        ("qwen2_moe", 37, {}),  # a shared expert beside the routed ones
        ("mixtral", 37, {"sliding_window": 24}),
        ("mistral", 37, {"sliding_window": 24}),
        ("phi3", 37, {"sliding_window": 24}),
        ("gemma3_text", 37, {"sliding_window": 24}),
        ("gemma3", 37, {"sliding_window": 24}),  # the image-text checkpoint's language model
        ("mistral3", 37, {"sliding_window": 24}),  # Mistral Small 3.1's image-text checkpoint's
        ("gemma", 37, {}),  # Gemma (1)
        ("gemma2", 37, {"sliding_window": 24}),  # soft-capped scores and logits
        ("granite", 37, {}),  # four multipliers
        ("smollm3", 37, {"no_rope_layers": [0, 1]}),  # the first layer without RoPE
        ("olmo2", 37, {}),  # the blocks' outputs normalized, q/k norms across all heads
        ("olmo3", 37, {"sliding_window": 24}),
        ("exaone4", 37, {"sliding_window": 24}),  # the global layer without RoPE
    ],
)
def test_greedy_matches_transformers(
    tmp_path: Path, ckpt: Path, arch: str, prompt_len: int, overrides: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if arch != "llama" or overrides:
        ckpt = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=1, **overrides)
    ids = prompt(prompt_len, seed=prompt_len)
    outs = run(make_engine(ckpt), {"r": (ids, greedy(32, logprobs=1))})["r"]
    got = tokens(outs)

    auto = AutoModelForImageTextToText if arch == "mistral3" else AutoModelForCausalLM
    hf = auto.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = gen.sequences[0, prompt_len:].tolist()
    assert got == expected
    assert len(got) == 32
    # Logprobs are the raw distribution's: compare with transformers' logits at every step.
    for i, out in enumerate(outs):
        hf_logp = torch.log_softmax(gen.logits[i][0].float(), dim=-1)
        assert out.new_logprobs is not None
        lp = out.new_logprobs[0]
        assert lp.token_id == expected[i]
        assert lp.logprob == pytest.approx(hf_logp[expected[i]].item(), abs=1e-4)
        assert lp.top[0][0] == expected[i]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert all(not o.finished for o in outs[:-1])
    assert outs[0].num_prompt_tokens == prompt_len and outs[0].num_cached_tokens == 0


def test_bias_and_repetition_penalty_match_transformers(ckpt: Path) -> None:
    """transformers' ``sequence_bias`` and ``repetition_penalty`` (the same order: the bias first)
    against the engine's ``logit_bias`` and ``repetition_penalty``, greedy; and they change the tokens."""
    from transformers import AutoModelForCausalLM

    ids = prompt(37, seed=4)
    bias = ((5, 3.0), (11, -2.0), (40, 1.5))
    engine_out = run(make_engine(ckpt), {"r": (ids, greedy(24, repetition_penalty=1.5, logit_bias=bias))})[
        "r"
    ]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            repetition_penalty=1.5,
            sequence_bias={(t,): b for t, b in bias},
        )
    assert tokens(engine_out) == gen[0, len(ids) :].tolist()
    assert tokens(engine_out) != tokens(run(make_engine(ckpt), {"r": (ids, greedy(24))})["r"])


def test_frequency_and_presence_penalties_match_the_formula_on_transformers_logits(ckpt: Path) -> None:
    """OpenAI's formula (``logit - count * frequency_penalty - (count > 0) * presence_penalty`` over
    the tokens generated so far) on transformers' logits, greedy, step by step."""
    from transformers import AutoModelForCausalLM

    ids = prompt(20, seed=6)
    plain = tokens(run(make_engine(ckpt), {"r": (ids, greedy(20))})["r"])
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for frequency, presence in [(1.5, 0.0), (0.0, 2.0), (-0.5, 1.0)]:
        want: list[int] = []
        with torch.no_grad():
            for _ in range(20):
                logits = hf(torch.tensor([ids + want])).logits[0, -1].float()
                for token in set(want):
                    logits[token] -= want.count(token) * frequency + presence
                want.append(int(logits.argmax()))
        params = greedy(20, frequency_penalty=frequency, presence_penalty=presence)
        assert tokens(run(make_engine(ckpt), {"r": (ids, params)})["r"]) == want, (frequency, presence)
        assert want != plain, (frequency, presence)  # the penalty changed what greedy picks


@pytest.mark.parametrize("budget", [512, 16])
def test_prompt_logprobs_match_transformers(ckpt: Path, budget: int) -> None:
    """Each prompt token's logprob, rank and top alternatives under the tokens before it, as
    transformers' logits give them, with the first token; in one chunk and in chunks of 16; a
    prompt the prefix cache already holds is still computed (and scored) whole."""
    from transformers import AutoModelForCausalLM

    ids = prompt(37, seed=9)
    engine = make_engine(ckpt, max_num_batched_tokens=budget)
    run(engine, {"warm": (ids, greedy(2))})  # the prompt's blocks now in the prefix cache
    outs = run(engine, {"r": (ids, greedy(3, prompt_logprobs=2))})["r"]
    scored = outs[0].prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    assert outs[0].num_cached_tokens == 0 and all(o.prompt_logprobs is None for o in outs[1:])
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # (37, V)
    for j in range(1, len(ids)):
        entry = scored[j]
        assert entry is not None and entry.token_id == ids[j]
        assert entry.logprob == pytest.approx(logp[j - 1, ids[j]].item(), abs=1e-4)
        want = logp[j - 1].topk(2)
        assert [t for t, _ in entry.top] == want.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert entry.rank == int((logp[j - 1] >= logp[j - 1, ids[j]]).sum())  # 1: the most likely
        assert entry.to_wire()[3] == entry.rank
    plain = tokens(run(engine, {"p": (ids, greedy(3))})["p"])
    assert tokens(outs) == plain  # scoring the prompt changes nothing of the generation
    assert engine.stats().prefix_cache_hit_tokens > 0  # the others did hit the cache


def test_a_cache_salt_shares_cached_blocks_only_with_its_own_salt(ckpt: Path) -> None:
    """vLLM's ``cache_salt``: a prompt's blocks cached under one salt are found by a request of that
    salt alone, not by another salt's or by an unsalted one (nor the reverse); the tokens are the
    same whatever the salt."""
    engine = make_engine(ckpt)
    ids = prompt(50, seed=40)  # three full blocks

    def cached(rid: str, salt: str | None) -> tuple[int, list[int]]:
        engine.add_request(rid, ids, greedy(3), cache_salt=salt)
        outs: list[RequestOutput] = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs[0].num_cached_tokens, tokens(outs)

    first, want = cached("a1", "tenant-a")
    assert first == 0
    assert cached("b1", "tenant-b") == (0, want)
    assert cached("n1", None) == (0, want)
    assert cached("a2", "tenant-a") == (48, want)
    assert cached("n2", None) == (48, want)  # the unsalted request's own blocks, cached by n1
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        engine.add_request("bad", ids, greedy(3), cache_salt="")


def test_priority_serves_the_lower_value_first(ckpt: Path) -> None:
    """vLLM's priority: one sequence at a time, requests come out by priority, equals in arrival
    order, each with the tokens it has alone; a priority that is not an int64 is refused."""
    engine = make_engine(ckpt, max_num_seqs=1)
    order = [("a", 0), ("b", 5), ("c", -1), ("d", 0)]
    for i, (rid, priority) in enumerate(order):
        engine.add_request(rid, prompt(12, seed=50 + i), greedy(3), priority=priority)
    finished: list[str] = []
    got: dict[str, list[int]] = {rid: [] for rid, _ in order}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finished.append(out.request_id)
    assert finished == ["c", "a", "d", "b"]
    for i, (rid, _) in enumerate(order):
        assert got[rid] == tokens(run(make_engine(ckpt), {rid: (prompt(12, seed=50 + i), greedy(3))})[rid])
    for bad in (True, 2**63, "1"):
        with pytest.raises(InvalidRequestError, match="priority"):
            engine.add_request("bad", [1, 2], greedy(2), priority=bad)  # type: ignore[arg-type]


def test_the_load_reports_rows_carry_priority_and_admission(ckpt: Path) -> None:
    """What the conductor orders a request's queue by (yutu.sched.QueuedPrefill): each prompt's
    priority, and whether the engine admitted it (its chunks run before any waiting prompt's)."""
    engine = make_engine(ckpt, max_num_seqs=1, max_num_batched_tokens=16)
    for i, (rid, priority) in enumerate([("a", 2), ("b", -1)]):
        engine.add_request(rid, prompt(40, seed=60 + i), greedy(2), priority=priority)
    queued, decoding = engine.queue_snapshot()
    assert queued == [[40, 0, 0, "b", -1, False], [40, 0, 0, "a", 2, False]] and decoding == []
    engine.step()  # b's first chunk of 16
    queued, _ = engine.queue_snapshot()
    assert queued == [[40, 0, 0, "a", 2, False], [40, 0, 16, "b", -1, True]]


def test_prompt_logprobs_refuse_kv_from_elsewhere(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    scored = greedy(4, prompt_logprobs=0)
    for extra in ({"import_tokens": 16}, {"generated": [5]}, {"prefill_only": True}):
        with pytest.raises(InvalidRequestError, match="computed whole here"):
            engine.add_request(f"r{len(extra)}", prompt(20, seed=2), scored, **extra)  # type: ignore[arg-type]
    one = run(engine, {"one": ([7], greedy(2, prompt_logprobs=1))})["one"]
    assert one[0].prompt_logprobs == [None]  # a one-token prompt: nothing before its token


def test_min_tokens_holds_the_stop_token_back_as_transformers_min_new_tokens_does(ckpt: Path) -> None:
    """A stop token greedy would emit third is held back until min_tokens are out (transformers'
    ``min_new_tokens`` with that token as eos); then it ends the request as usual."""
    from transformers import AutoModelForCausalLM

    ids = prompt(30, seed=12)
    plain = tokens(run(make_engine(ckpt), {"r": (ids, greedy(12))})["r"])
    stop = next(t for i, t in enumerate(plain) if i >= 2 and t not in plain[:i])
    early = tokens(run(make_engine(ckpt), {"r": (ids, greedy(12, stop_token_ids=(stop,)))})["r"])
    assert early[-1] == stop and len(early) < 6
    held = run(make_engine(ckpt), {"r": (ids, greedy(12, stop_token_ids=(stop,), min_tokens=6))})["r"]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=12,
            min_new_tokens=6, do_sample=False, eos_token_id=stop, pad_token_id=0,
        )  # fmt: skip
    assert tokens(held) == gen[0, len(ids) :].tolist()
    assert stop not in tokens(held)[:6]


def test_logit_bias_ids_outside_the_vocabulary_are_refused(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids must be integers in \[0, 512\)"):
        engine.add_request("r", prompt(5, seed=1), greedy(4, logit_bias=((512, 1.0),)))


def test_prefix_cache_hit_gives_cold_tokens(ckpt: Path) -> None:
    base = prompt(40, seed=1)
    other = base[:35] + prompt(10, seed=2)  # shares 35 tokens: 2 full blocks of 16
    cold = run_alone(ckpt, {"b": (other, greedy(12))})["b"]

    engine = make_engine(ckpt)
    first = run(engine, {"a": (base, greedy(9))})["a"]
    assert first[0].num_cached_tokens == 0
    second = run(engine, {"b": (other, greedy(12))})["b"]
    assert tokens(second) == cold
    assert second[0].num_cached_tokens == 32
    assert all(o.num_cached_tokens == 32 for o in second)
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 32
    assert stats.prefix_cache_queries_tokens == 40 + 45

    # A follow-up turn = a's prompt + its 9 generated tokens (49 tokens; 48 of them computed):
    # three full blocks, the third made partly of generated tokens.
    follow = base + tokens(first) + prompt(3, seed=3)
    cold_follow = run_alone(ckpt, {"c": (follow, greedy(6))})["c"]
    third = run(engine, {"c": (follow, greedy(6))})["c"]
    assert third[0].num_cached_tokens == 48
    assert tokens(third) == cold_follow


def test_full_prefix_hit_recomputes_last_block(ckpt: Path) -> None:
    ids = prompt(32, seed=4)  # exactly two blocks
    engine = make_engine(ckpt)
    first = run(engine, {"a": (ids, greedy(4))})["a"]
    again = run(engine, {"b": (ids, greedy(4))})["b"]
    assert again[0].num_cached_tokens == 16  # the block holding the last token is recomputed
    assert tokens(again) == tokens(first)


MIXED = [(3, 5), (17, 12), (33, 20), (50, 8), (70, 16)]


ADJUSTED = {  # requests of the mixed batch whose logits a bias or a penalty changes
    1: {"frequency_penalty": 1.0, "presence_penalty": 0.5},
    3: {"repetition_penalty": 1.3, "logit_bias": ((7, 2.0), (9, -1.0))},
}


def mixed_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        f"m{i}": (prompt(n, seed=100 + i), greedy(m, **ADJUSTED.get(i, {}))) for i, (n, m) in enumerate(MIXED)
    }


@pytest.fixture(scope="module")
def mixed_alone(ckpt: Path) -> dict[str, list[int]]:
    return run_alone(ckpt, mixed_requests())


@pytest.mark.parametrize("budget", [512, 16])
def test_mixed_batch_equals_alone(ckpt: Path, mixed_alone: dict[str, list[int]], budget: int) -> None:
    engine = make_engine(ckpt, max_num_batched_tokens=budget)
    outs = run(engine, mixed_requests())
    assert {rid: tokens(o) for rid, o in outs.items()} == mixed_alone
    assert {rid: len(t) for rid, t in mixed_alone.items()} == {f"m{i}": m for i, (_, m) in enumerate(MIXED)}
    stats = engine.stats()
    assert stats.prompt_tokens_total == sum(n for n, _ in MIXED)
    assert stats.generation_tokens_total == sum(m for _, m in MIXED)
    assert stats.num_preemptions == 0


def test_preemption_gives_same_tokens(ckpt: Path) -> None:
    requests = {
        f"p{i}": (
            prompt(n, seed=200 + i),
            greedy(m, frequency_penalty=0.8 * (i == 1))
            if i != 2
            else SamplingParams(temperature=1.0, seed=9, max_tokens=m),
        )
        for i, (n, m) in enumerate([(20, 30), (25, 40), (30, 30), (18, 44)])
    }
    # a grammar keeps its matcher through a preemption (the recompute takes no token again)
    requests["p4"] = (prompt(22, seed=204), greedy(40, grammar=grammar_from("regex", "[a-z]{20,30}")))
    alone = run_alone(ckpt, requests)
    # 12 blocks of 8 tokens = 96 token slots; the five requests need 50 + 65 + 60 + 62 + up to 62.
    engine = make_engine(ckpt, block_size=8, num_kv_blocks=12, max_model_len=96)
    outs = run(engine, requests)
    assert engine.stats().num_preemptions > 0
    assert {rid: tokens(o) for rid, o in outs.items()} == alone


def test_seeded_sampling_is_per_request(ckpt: Path) -> None:
    ids = prompt(12, seed=300)
    seeded = SamplingParams(temperature=3.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = run_alone(ckpt, {"s": (ids, seeded)})["s"]
    batch = {
        "noise1": (prompt(30, seed=301), SamplingParams(temperature=3.0, max_tokens=7, ignore_eos=True)),
        "s": (ids, seeded),
        "noise2": (
            prompt(5, seed=302),
            SamplingParams(temperature=3.0, seed=99, max_tokens=25, ignore_eos=True),
        ),
        "noise3": (prompt(9, seed=303), greedy(11)),
    }
    assert tokens(run(make_engine(ckpt, max_num_batched_tokens=16), batch)["s"]) == alone
    other_seed = SamplingParams(temperature=3.0, seed=4321, max_tokens=20, ignore_eos=True)
    assert run_alone(ckpt, {"s": (ids, other_seed)})["s"] != alone
    assert len(set(alone)) > 5  # high-entropy sampling, not a constant


def test_abort_frees_blocks(ckpt: Path) -> None:
    engine = make_engine(ckpt, max_num_seqs=2)
    engine.add_request("a", prompt(40, seed=400), greedy(50))
    engine.add_request("b", prompt(20, seed=401), greedy(50))
    engine.add_request("c", prompt(20, seed=402), greedy(50))  # waits: max_num_seqs=2
    for _ in range(3):
        engine.step()
        engine.block_manager.check_integrity()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.num_free_blocks == 64 - 3 - 2
    engine.abort_request("a")
    engine.block_manager.check_integrity()
    assert engine.stats().num_free_blocks == 64 - 2
    engine.abort_request("c")  # from the waiting queue
    engine.abort_request("nope")  # unknown: no-op
    assert engine.stats().num_waiting == 0
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert {o.request_id for o in outs} == {"b"}
    assert engine.stats().num_free_blocks == 64 and engine.stats().kv_usage == 0.0
    engine.block_manager.check_integrity()


def test_stop_token_ids_and_eos(tmp_path: Path, ckpt: Path) -> None:
    ids = prompt(10, seed=500)
    free_run = tokens(run(make_engine(ckpt), {"r": (ids, greedy(16))})["r"])
    stop = free_run[5]
    first = free_run.index(stop)
    outs = run(make_engine(ckpt), {"r": (ids, greedy(16, stop_token_ids=(stop,)))})["r"]
    assert tokens(outs) == free_run[: first + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    # The same token as the model's eos (same weights, other config): stops unless ignore_eos.
    eos_ckpt = make_tiny_checkpoint(tmp_path / "eos", arch="llama", seed=0, eos_token_id=stop)
    engine = make_engine(eos_ckpt)
    assert stop in engine.model_config.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=16)
    both = run(engine, {"r": (ids, params), "i": (ids, greedy(16))})
    assert tokens(both["r"]) == free_run[: first + 1]
    assert both["r"][-1].finish_reason is FinishReason.STOP
    assert tokens(both["i"]) == free_run


def test_bad_requests(ckpt: Path) -> None:
    engine = make_engine(ckpt, max_model_len=64)
    with pytest.raises(PromptTooLongError, match="maximum context length is 64 tokens, but 65"):
        engine.add_request("r", prompt(60, seed=1), SamplingParams(max_tokens=5))
    engine.add_request("ok", prompt(59, seed=1), SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request("ok", [1], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"integers in \[0, 512\)"):
        engine.add_request("v", [1, 512, -1], SamplingParams())
    # the fast check's edges: the full check names what it refuses
    for bad, named in (([1, True], "True"), ([1, 2.0], "2.0"), ([-1, 3], "-1"), ([3, 512], "512")):
        with pytest.raises(InvalidRequestError, match=rf"integers in \[0, 512\); got \[{named}\]"):
            engine.add_request("v", bad, SamplingParams())
    assert isinstance(PromptTooLongError("x"), ValueError)
    engine.abort_request("ok")
    engine.block_manager.check_integrity()


def test_config_validation(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        make_engine(ckpt, num_kv_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=512"):
        make_engine(ckpt, max_model_len=1024)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig(model_dir=ckpt, block_size=0)
    engine = make_engine(ckpt, num_kv_blocks=4, max_model_len=None, block_size=16)
    assert engine.max_model_len == 64  # derived: the pool holds 64 tokens < 512 positions
    assert EngineConfig(model_dir=ckpt).model_id == "tiny-llama"


def test_a_longrope_model_past_its_pretraining_length_takes_the_long_factors(tmp_path: Path) -> None:
    """By default a LongRoPE engine stops at the pretraining length (its short factors; a longer
    prompt is too long); asked for more, every sequence is rotated by the long factors -- a prompt
    past the pretraining length generates what transformers does (it rotates such a sequence by its
    long factors), and block keys are salted apart from the short factors' (other KV)."""
    from transformers import AutoModelForCausalLM

    rope = {
        "type": "longrope",
        "short_factor": [1.0 + i / 10 for i in range(8)],
        "long_factor": [2.0 + i for i in range(8)],
    }
    ckpt = make_tiny_checkpoint(tmp_path, "phi3", max_position_embeddings=512, original_max_position_embeddings=96,
                                rope_scaling=rope)  # fmt: skip
    short = make_engine(ckpt, max_model_len=None)
    assert short.max_model_len == 96 and short.model_config.longrope_regime == "short"
    with pytest.raises(PromptTooLongError):
        short.add_request("long", prompt(100, seed=1), greedy(1))
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=512"):
        make_engine(ckpt, max_model_len=600)
    long = make_engine(ckpt, max_model_len=160)
    assert long.max_model_len == 160 and long.model_config.longrope_regime == "long"
    assert long.kv_salt == short.kv_salt + "+longrope-long"
    assert long.root_key != short.root_key  # the prefix cache and the store key its blocks apart
    ids = prompt(100, seed=1)
    got = tokens(run(long, {"r": (ids, greedy(24))})["r"])
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert got == gen[0, len(ids) :].tolist()
    # the same prompt by the short factors' engine (cut to fit): other numbers, not just other keys
    within = ids[:90]
    by_short = tokens(run(make_engine(ckpt, max_model_len=None), {"r": (within, greedy(4))})["r"])
    by_long = tokens(run(make_engine(ckpt, max_model_len=160), {"r": (within, greedy(4))})["r"])
    assert by_short != by_long


def test_stats_count_the_prompts_still_to_prefill(ckpt: Path) -> None:
    engine = make_engine(ckpt, max_num_seqs=2, max_num_batched_tokens=16)
    engine.add_request("long", prompt(40, seed=410), greedy(5))  # 3 chunks of <= 16 tokens
    engine.add_request("short", prompt(8, seed=411), greedy(5))
    engine.add_request("later", prompt(8, seed=412), greedy(5))  # waits: max_num_seqs=2
    assert engine.stats().num_prefilling == 3  # all waiting
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        sched = engine.scheduler
        mid_prompt = [s for s in sched.running if s.num_computed_tokens < s.num_prompt_tokens]
        assert engine.stats().num_prefilling == len(sched.waiting) + len(mid_prompt)
        seen.add(engine.stats().num_prefilling)
    assert engine.stats().num_prefilling == 0
    assert {3, 0} <= seen and len(seen) >= 3  # prompts finished while others decoded
