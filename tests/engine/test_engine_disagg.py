"""The engine's disaggregation primitives on a tiny real model: hold a prefill-only request's blocks,
import KV into an admitted request's blocks, continue from tokens generated elsewhere.

The "transfer" here is a tensor copy between two engines' caches (what the transfer engine does
between two workers' registered regions); the reference is one engine running the request whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from yutu.engine.engine import LLMEngine, RequestOutput
from yutu.engine.errors import InvalidRequestError
from yutu.engine.sampling import SamplingParams
from yutu.engine.scheduler import KVLoad
from yutu.engine.sequence import RequestStatus
from yutu.engine.testing import make_tiny_checkpoint

from tests.engine.engine_support import make_engine, prompt

BS = 16


def drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.block_manager.check_integrity()
    assert not engine.has_unfinished_requests()
    return outputs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def logprobs(outs: list[RequestOutput]) -> list[float]:
    return [lp.logprob for o in outs for lp in (o.new_logprobs or [])]


def reference(ckpt: Path, ids: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine = make_engine(ckpt)
    engine.add_request("ref", ids, params)
    return drain(engine)["ref"]


def copy_blocks(src: LLMEngine, src_blocks: list[int], dst: LLMEngine, dst_blocks: list[int]) -> None:
    """What the decode's batched READ does: block i of the source into block i of the destination."""
    dst.runner.kv_cache[dst_blocks] = src.runner.kv_cache[src_blocks]


def prefill(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams) -> RequestOutput:
    engine.add_request(rid, ids, params, prefill_only=True)
    (out,) = drain(engine)[rid]
    return out


def handoff(
    prefiller: LLMEngine, first: RequestOutput, decoder: LLMEngine, ids: list[int], params: SamplingParams
) -> list[RequestOutput]:
    """Decode on ``decoder`` what ``prefiller`` prefilled: import its KV, then run to the end."""
    assert first.kv_held is not None
    rid = first.request_id
    decoder.add_request(rid, ids, params, generated=first.new_token_ids, import_tokens=len(ids))
    assert drain(decoder) == {}  # admitted into loading: no step output yet
    (load,) = decoder.take_loads()
    assert load.seq_id == rid and load.num_tokens == len(ids)
    first_block = load.first_block
    copy_blocks(prefiller, first.kv_held.block_ids[first_block : first_block + len(load.block_ids)],
                decoder, load.block_ids)  # fmt: skip
    assert prefiller.release(rid)
    decoder.finish_load(rid, len(ids))
    return drain(decoder)[rid]


@pytest.mark.parametrize("length", [40, 48, 1])  # a partial last block, an exact one, one token
def test_prefill_then_decode_elsewhere_equals_one_engine(ckpt: Path, length: int) -> None:
    ids = prompt(length, seed=length)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = reference(ckpt, ids, params)
    prefiller, decoder = make_engine(ckpt), make_engine(ckpt)
    first = prefill(prefiller, "r", ids, params)
    assert first.finished and first.finish_reason is None and first.kv_held is not None
    assert first.kv_held.num_tokens == length
    assert len(first.kv_held.block_ids) == -(
        -length // BS
    )  # the prompt's blocks (the first token has no KV yet)
    assert prefiller.num_held == 1 and prefiller.stats().num_held == 1
    assert first.prefill_s is not None and first.prefill_s > 0
    rest = handoff(prefiller, first, decoder, ids, params)
    assert tokens([first, *rest]) == tokens(ref)
    assert logprobs([first, *rest]) == pytest.approx(logprobs(ref), abs=1e-5)
    assert rest[-1].finished and rest[-1].finish_reason is not None
    for engine in (prefiller, decoder):
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0
    assert prefiller.num_held == 0 and not prefiller.release("r")


@pytest.mark.parametrize("arch", ["gemma3_text", "gemma3", "gemma2", "olmo3", "mistral3", "phi3", "mixtral"])
def test_other_architectures_hand_over_as_llama_does(tmp_path: Path, arch: str) -> None:
    """The KV handed over is every layer's, whatever computes it: Gemma 3's sliding and full layers
    (each rotated by its own base; also from an image-text checkpoint), Gemma 2's (soft-capped
    attention), OLMo 3's, Phi-3's, a mixture's -- prefill here, decode there, one engine's tokens."""
    model_dir = make_tiny_checkpoint(tmp_path, arch, seed=4, sliding_window=16)
    ids = prompt(40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    prefiller, decoder = make_engine(model_dir), make_engine(model_dir)
    first = prefill(prefiller, "g", ids, params)
    rest = handoff(prefiller, first, decoder, ids, params)
    ref = reference(model_dir, ids, params)
    assert tokens([first, *rest]) == tokens(ref)
    assert logprobs([first, *rest]) == pytest.approx(logprobs(ref), abs=1e-5)


def test_seeded_sampling_continues_the_same_stream_after_a_handoff(ckpt: Path) -> None:
    ids = prompt(37, seed=5)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    ref = reference(ckpt, ids, params)
    prefiller, decoder = make_engine(ckpt), make_engine(ckpt)
    first = prefill(prefiller, "s", ids, params)
    assert tokens([first, *handoff(prefiller, first, decoder, ids, params)]) == tokens(ref)


def test_decoder_reuses_its_own_prefix_cache_and_imports_only_the_rest(ckpt: Path) -> None:
    shared = prompt(32, seed=9)  # two full blocks the decoder already computed
    ids = shared + prompt(20, seed=10)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    decoder = make_engine(ckpt)
    decoder.add_request("warm", shared + [7, 8, 9], SamplingParams(temperature=0, max_tokens=1))
    drain(decoder)
    prefiller = make_engine(ckpt)
    first = prefill(prefiller, "x", ids, params)
    assert first.kv_held is not None
    decoder.add_request("x", ids, params, generated=first.new_token_ids, import_tokens=len(ids))
    drain(decoder)
    (load,) = decoder.take_loads()
    assert (load.first_block, load.num_cached_tokens, len(load.block_ids)) == (2, 32, 2)  # tokens 32..51
    copy_blocks(prefiller, first.kv_held.block_ids[2:4], decoder, load.block_ids)
    prefiller.release("x")
    decoder.finish_load("x", len(ids))
    assert tokens([first, *drain(decoder)["x"]]) == tokens(reference(ckpt, ids, params))


def test_partial_import_computes_the_rest(ckpt: Path) -> None:
    ids = prompt(50, seed=3)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prefiller, decoder = make_engine(ckpt), make_engine(ckpt)
    first = prefill(prefiller, "p", ids, params)
    assert first.kv_held is not None
    decoder.add_request("p", ids, params, generated=first.new_token_ids, import_tokens=len(ids))
    drain(decoder)
    (load,) = decoder.take_loads()
    copy_blocks(prefiller, first.kv_held.block_ids[:1], decoder, load.block_ids[:1])  # only block 0 came
    prefiller.release("p")
    decoder.finish_load("p", BS)
    assert tokens([first, *drain(decoder)["p"]]) == tokens(reference(ckpt, ids, params))
    # "p" left its 3 full blocks in the decoder's prefix cache: a load may not claim less than that
    with pytest.raises(ValueError, match="loaded 0 tokens, expected between 48 and 49"):
        decoder.add_request("q", ids, params, import_tokens=len(ids) - 1)
        drain(decoder)
        decoder.take_loads()
        decoder.finish_load("q", 0)


def test_abort_while_loading_frees_blocks_only_after_the_copy(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    ids = prompt(40, seed=1)
    engine.add_request("a", ids, SamplingParams(temperature=0, max_tokens=3), import_tokens=39)
    drain(engine)
    (load,) = engine.take_loads()
    assert engine.stats().num_loading == 1 and not engine.has_unfinished_requests()
    engine.abort_request("a")
    assert engine.block_manager.num_used_blocks == 3  # a copy may still be writing into them
    assert engine.scheduler.abandoned["a"].status is RequestStatus.FINISHED_ABORTED
    engine.finish_load("a", 39)
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.abandoned
    engine.block_manager.check_integrity()
    assert engine.take_loads() == [] and load.seq_id == "a"


def test_continuing_from_generated_tokens_equals_an_uninterrupted_run(ckpt: Path) -> None:
    """A migration: another engine recomputes prompt + tokens so far and samples the next ones."""
    ids = prompt(30, seed=11)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    ref = tokens(reference(ckpt, ids, params))
    engine = make_engine(ckpt)
    engine.add_request("m", ids, params, generated=ref[:4])
    assert tokens(drain(engine)["m"]) == ref[4:]


def test_first_token_that_ends_the_request_holds_nothing(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    out = prefill(engine, "one", prompt(20, seed=2), SamplingParams(temperature=0, max_tokens=1))
    assert out.finished and out.finish_reason is not None and out.kv_held is None
    assert engine.num_held == 0 and engine.block_manager.num_used_blocks == 0


def test_bad_disaggregation_arguments_are_refused(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    ids = prompt(10, seed=1)
    params = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(InvalidRequestError, match="one token is always computed"):
        engine.add_request("a", ids, params, import_tokens=10)
    with pytest.raises(InvalidRequestError, match="nothing left to do"):
        engine.add_request("b", ids, params, generated=[5, 6, 7])
    with pytest.raises(InvalidRequestError, match="cannot carry generated tokens"):
        engine.add_request("c", ids, params, generated=[5], prefill_only=True)
    with pytest.raises(InvalidRequestError, match=r"generated token ids must be integers in \[0, 512\)"):
        engine.add_request("d", ids, params, generated=[9999])


def test_an_import_the_prefix_cache_covers_runs_at_once_and_says_so(ckpt: Path) -> None:
    ids = prompt(48, seed=4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = make_engine(ckpt)
    engine.add_request("warm", ids + [9], SamplingParams(temperature=0, max_tokens=1))
    drain(engine)
    engine.add_request("x", ids, params, import_tokens=32)  # 3 blocks cached >= 2 blocks to import
    out = drain(engine)["x"]
    (load,) = engine.take_loads()
    assert not load.needed and load.block_ids == [] and load.num_cached_tokens == 32
    assert tokens(out) == tokens(reference(ckpt, ids, params))


def test_prompts_computed_in_one_step_each_report_their_share_of_it(ckpt: Path) -> None:
    """prefill_s feeds the conductor's prefill cost model, which adds an instance's queued prompts
    one after another: prompts computed in one step each report their tokens' share of it, not all
    of it (a decode in the same step is one token)."""
    engine = make_engine(ckpt, num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("decoding", prompt(9, seed=1), params)
    engine.step()  # its prompt and first token: it decodes in the next step
    for i in range(3):
        engine.add_request(f"p{i}", prompt(21, seed=10 + i), params)
    outs = {out.request_id: out for out in engine.step()}
    step = engine.last_step
    assert step is not None and (step.num_decodes, step.num_prefill_tokens) == (1, 63)
    for i in range(3):
        assert outs[f"p{i}"].prefill_s == pytest.approx(step.seconds * 21 / 64)


def test_on_loads_hands_a_steps_imports_over_before_its_forward_pass(ckpt: Path) -> None:
    """On a decoder busy with another request, the import a step admits reaches ``on_loads`` before
    that step computes (its copy can overlap the step), and the request then runs as one engine."""
    ids = prompt(40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefiller, decoder = make_engine(ckpt), make_engine(ckpt)
    first = prefill(prefiller, "x", ids, params)
    assert first.kv_held is not None
    decoder.add_request("busy", prompt(20, seed=4), params)
    decoder.step()  # "busy" prefilled: it decodes in the next steps
    seen: list[tuple[list[KVLoad], int]] = []
    decoder.on_loads = lambda loads: seen.append((loads, decoder.stats().generation_tokens_total))
    decoder.add_request("x", ids, params, generated=first.new_token_ids, import_tokens=len(ids))
    before = decoder.stats().generation_tokens_total
    (out,) = decoder.step()  # admits "x" into loading while "busy" decodes
    assert out.request_id == "busy" and len(out.new_token_ids) == 1
    ((load,), generated_then) = seen[0]
    assert len(seen) == 1 and generated_then == before  # handed over before the step's token
    assert load.seq_id == "x" and load.num_tokens == len(ids)
    assert decoder.take_loads() == []  # on_loads had them
    copy_blocks(prefiller, first.kv_held.block_ids[load.first_block : load.first_block + len(load.block_ids)],
                decoder, load.block_ids)  # fmt: skip
    prefiller.release("x")
    decoder.finish_load("x", len(ids))
    rest = drain(decoder)["x"]
    assert tokens([first, *rest]) == tokens(reference(ckpt, ids, params))
    assert len(seen) == 1  # no further imports


def test_what_on_loads_raises_is_the_callers_and_not_contained_as_a_failed_step(ckpt: Path) -> None:
    """A caller that cannot take the imports is broken itself: the step does not swallow it (the
    worker's core then goes to its broken mode, as when sending the loads after the step failed)."""
    ids = prompt(40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    decoder = make_engine(ckpt)

    def gone(loads: list[KVLoad]) -> None:
        raise ConnectionError("the worker is gone")

    decoder.on_loads = gone
    decoder.add_request("x", ids, params, generated=[5], import_tokens=len(ids))
    with pytest.raises(ConnectionError, match="the worker is gone"):
        decoder.step()
    assert decoder.consecutive_failed_steps == 0 and decoder.stats().failed_requests_total == 0


def awaited_handoff(
    prefiller: LLMEngine,
    decoder: LLMEngine,
    rid: str,
    ids: list[int],
    params: SamplingParams,
    copied: int | None = None,
) -> list[RequestOutput]:
    """A decoder told before the prefill: it admits the request (blocks taken, load listed) while the
    prefiller computes, then gets the KV and the first token together. ``copied``: leading tokens that
    arrive (a partial copy; default all)."""
    decoder.add_request(rid, ids, params, import_tokens=len(ids), await_token=True)
    assert drain(decoder) == {}  # admitted into loading, before the prefill even started
    (load,) = decoder.take_loads()
    assert (load.seq_id, load.first_block, load.num_tokens) == (rid, 0, len(ids))
    assert len(load.block_ids) == -(-len(ids) // BS)  # the prompt's blocks: the token has no KV yet
    first = prefill(prefiller, rid, ids, params)
    assert first.kv_held is not None and first.finish_reason is None
    copied = len(ids) if copied is None else copied
    n = -(-copied // BS)
    copy_blocks(prefiller, first.kv_held.block_ids[:n], decoder, load.block_ids[:n])
    assert prefiller.release(rid)
    decoder.finish_load(rid, copied, token=first.new_token_ids[0])
    return [first, *drain(decoder)[rid]]


@pytest.mark.parametrize(
    "length", [40, 48, 1]
)  # the awaited token in a partial block, starting one, a 1-token prompt
def test_a_request_admitted_before_its_first_token_equals_one_engine(ckpt: Path, length: int) -> None:
    ids = prompt(length, seed=20 + length)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = reference(ckpt, ids, params)
    prefiller, decoder = make_engine(ckpt), make_engine(ckpt)
    outs = awaited_handoff(prefiller, decoder, "w", ids, params)
    assert tokens(outs) == tokens(ref)
    assert logprobs(outs) == pytest.approx(logprobs(ref), abs=1e-5)
    assert outs[-1].finished and outs[-1].num_cached_tokens == length
    for engine in (prefiller, decoder):
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0


def test_a_seeded_request_admitted_before_its_first_token_continues_the_same_stream(ckpt: Path) -> None:
    ids = prompt(37, seed=5)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    ref = reference(ckpt, ids, params)
    outs = awaited_handoff(make_engine(ckpt), make_engine(ckpt), "s", ids, params)
    assert tokens(outs) == tokens(ref)


@pytest.mark.parametrize("copied", [16, 0])  # one block of three came, none did
def test_a_partial_copy_of_an_awaited_request_computes_the_rest(ckpt: Path, copied: int) -> None:
    ids = prompt(48, seed=6)  # the awaited token starts block 3: the step computing it needs that block
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = reference(ckpt, ids, params)
    decoder = make_engine(ckpt)
    assert tokens(awaited_handoff(make_engine(ckpt), decoder, "p", ids, params, copied)) == tokens(ref)
    decoder.block_manager.check_integrity()
    assert decoder.block_manager.num_used_blocks == 0


def test_an_awaited_token_with_no_block_free_for_it_is_recomputed_once_there_is_room(ckpt: Path) -> None:
    """48 prompt tokens fill 3 blocks; the awaited token needs a 4th. With none free when it arrives,
    the request goes back to the waiting queue and runs once another request has freed blocks."""
    ids = prompt(48, seed=7)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = reference(ckpt, ids, params)
    prefiller, decoder = make_engine(ckpt), make_engine(ckpt, num_kv_blocks=5, max_model_len=64)
    decoder.add_request(
        "busy", prompt(20, seed=8), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    decoder.step()  # "busy": 2 blocks (20 prompt tokens + its tokens stay within them)
    decoder.add_request("w", ids, params, import_tokens=len(ids), await_token=True)
    decoder.step()  # admits "w" into loading: its 3 blocks; nothing is left
    (load,) = decoder.take_loads()
    assert decoder.block_manager.num_free_blocks == 0
    first = prefill(prefiller, "w", ids, params)
    assert first.kv_held is not None
    copy_blocks(prefiller, first.kv_held.block_ids, decoder, load.block_ids)
    prefiller.release("w")
    decoder.finish_load("w", len(ids), token=first.new_token_ids[0])
    assert decoder.scheduler.waiting[0].seq_id == "w" and decoder.scheduler.num_preemptions == 1
    outs = drain(decoder)
    assert tokens([first, *outs["w"]]) == tokens(ref)
    decoder.block_manager.check_integrity()
    assert decoder.block_manager.num_used_blocks == 0


def test_an_awaited_request_aborted_while_loading_frees_its_blocks_once_the_copy_ended(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    engine.add_request("a", prompt(40, seed=1), SamplingParams(temperature=0, max_tokens=3),
                       import_tokens=40, await_token=True)  # fmt: skip
    drain(engine)
    (load,) = engine.take_loads()
    engine.abort_request("a")
    assert engine.block_manager.num_used_blocks == 3
    engine.finish_load("a", 0)  # the worker's answer for a copy that never started: no token needed
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.abandoned
    assert load.seq_id == "a"


def test_awaited_tokens_come_with_the_requests_that_await_them_only(ckpt: Path) -> None:
    engine = make_engine(ckpt)
    ids = prompt(10, seed=1)
    params = SamplingParams(temperature=0, max_tokens=3)
    for kwargs, match in [
        ({"import_tokens": 9}, "imports its whole prompt's KV"),
        ({"import_tokens": 10, "generated": [5]}, "has nothing generated"),
        ({"import_tokens": 10, "prefill_only": True}, "is not prefill-only"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request("x", ids, params, await_token=True, **kwargs)
    with pytest.raises(InvalidRequestError, match=r"max_tokens >= 2, got 1"):
        engine.add_request(
            "x", ids, SamplingParams(temperature=0, max_tokens=1), import_tokens=10, await_token=True
        )
    engine.add_request("w", ids, params, import_tokens=10, await_token=True)
    engine.add_request("i", ids, params, import_tokens=9)
    drain(engine)
    assert sorted(load.seq_id for load in engine.take_loads()) == ["i", "w"]
    with pytest.raises(InvalidRequestError, match="awaits its first token: finish_load must bring it"):
        engine.finish_load("w", 10)
    with pytest.raises(InvalidRequestError, match="awaits no token: finish_load must not bring one"):
        engine.finish_load("i", 9, token=5)
    with pytest.raises(InvalidRequestError, match=r"the awaited token ids must be integers in \[0, 512\)"):
        engine.finish_load("w", 10, token=512)
    engine.finish_load("w", 10, token=5)
    engine.finish_load("i", 9)
    outs = drain(engine)
    assert len(tokens(outs["w"])) == 2 and len(tokens(outs["i"])) == 3  # "w" had its first token already
    engine.block_manager.check_integrity()


def test_requests_awaiting_their_first_token_hold_at_most_half_the_pool(ckpt: Path) -> None:
    """Blocks reserved for prompts still prefilled elsewhere must not crowd out what decodes here:
    past half the pool an awaiting request waits, and the requests behind it are admitted."""
    engine = make_engine(ckpt, num_kv_blocks=10, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("w1", prompt(48, seed=1), params, import_tokens=48, await_token=True)  # 3 blocks
    engine.add_request("w2", prompt(48, seed=2), params, import_tokens=48, await_token=True)  # 3 more: > 5
    engine.add_request("plain", prompt(20, seed=3), params)
    outs = engine.step()
    assert [load.seq_id for load in engine.take_loads()] == ["w1"]
    assert [s.seq_id for s in engine.scheduler.waiting] == ["w2"]  # passed over; "plain" runs
    assert [s.seq_id for s in engine.scheduler.running] == ["plain"]
    engine.finish_load("w1", 0, token=7)  # w1's KV came (none copied here: computed) with its token
    outs += engine.step()
    assert [load.seq_id for load in engine.take_loads()] == ["w2"]  # w1 awaits no more: room for w2
    engine.finish_load("w2", 0, token=9)
    outs += [out for outs_ in drain(engine).values() for out in outs_]
    assert sorted(out.request_id for out in outs for _ in out.new_token_ids) == ["plain", "plain", "w1", "w2"]
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
