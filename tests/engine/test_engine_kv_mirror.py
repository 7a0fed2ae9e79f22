"""The KV cache's host mirror (yutu.engine.kv_mirror): what an engine on a GPU shares with peers.

On the CPU the mirror is asked for (``kv_mirror=True``), so the same code runs here as on a GPU:
the engine computes in its own cache and a separate host tensor stands for the worker's region.
With ``YUTU_TEST_DEVICE=cuda`` (loadtests/gpu_check.sh) the cache is in GPU memory. The reference is
one engine running the request whole; the "transfer" is a copy between the two host tensors, as
the transfer engine copies between two workers' regions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import TEST_DEVICE, make_engine, prompt
from yutu.engine.engine import LLMEngine, RequestOutput
from yutu.engine.sampling import SamplingParams


def mirrored(ckpt: Path, **overrides: Any) -> tuple[LLMEngine, torch.Tensor]:
    """An engine with a host mirror, and that mirror (what a worker's region would be)."""
    hosts: list[torch.Tensor] = []

    def region(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        hosts.append(torch.zeros(shape, dtype=dtype))
        return hosts[-1]

    engine = make_engine(ckpt, kv_mirror=True, kv_cache_factory=region, **overrides)
    assert engine.mirror is not None and engine.mirror.host is hosts[0]
    assert engine.runner.kv_cache.data_ptr() != hosts[0].data_ptr()
    assert engine.runner.kv_cache.device.type == TEST_DEVICE
    return engine, hosts[0]


def drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_and_logprobs(outs: list[RequestOutput]) -> tuple[list[int], list[float]]:
    return [t for o in outs for t in o.new_token_ids], [
        lp.logprob for o in outs for lp in o.new_logprobs or ()
    ]


def same_blocks(engine: LLMEngine, host: torch.Tensor, block_ids: list[int]) -> bool:
    rows = torch.tensor(block_ids)
    return torch.equal(engine.runner.kv_cache.index_select(0, rows.to(engine.device)).cpu(), host[rows])


@pytest.mark.parametrize("length", [40, 48])  # a partial last block, an exact one
def test_a_handoff_through_host_mirrors_equals_one_engine(ckpt: Path, length: int) -> None:
    ids = prompt(length, seed=length)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    reference = make_engine(ckpt)
    reference.add_request("r", ids, params)
    expected = tokens_and_logprobs(drain(reference)["r"])

    prefiller, prefill_host = mirrored(ckpt)
    prefiller.add_request("r", ids, params, prefill_only=True)
    (first,) = drain(prefiller)["r"]
    assert first.kv_held is not None
    held = first.kv_held.block_ids
    assert same_blocks(prefiller, prefill_host, held)  # on the host before the output said so

    decoder, decode_host = mirrored(ckpt)
    decoder.add_request("r", ids, params, generated=first.new_token_ids, import_tokens=length)
    assert drain(decoder) == {}
    (load,) = decoder.take_loads()
    decode_host[load.block_ids] = prefill_host[held[load.first_block :]]  # the transfer engine's copy
    assert prefiller.release("r")
    decoder.finish_load("r", length)  # host -> device, before the request runs
    assert same_blocks(decoder, decode_host, load.block_ids)
    got = tokens_and_logprobs([first, *drain(decoder)["r"]])
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], abs=1e-5)


def test_blocks_committed_to_the_prefix_cache_reach_the_host_when_their_events_are_taken(ckpt: Path) -> None:
    engine, host = mirrored(ckpt)
    engine.block_manager.record_events = True
    engine.add_request("a", prompt(70, seed=3), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()  # the prompt: four full blocks of 16 (and 6 tokens of a fifth)
    assert not bool(host.any())  # nothing copied until the events are taken
    stored = [e.block_id for e in engine.take_cache_events() if e.stored]
    assert len(stored) == 4 and same_blocks(engine, host, stored)
    drain(engine)
    more = [e.block_id for e in engine.take_cache_events() if e.stored]
    assert len(more) == 1 and same_blocks(engine, host, stored + more)  # 89 tokens computed: five blocks


def test_an_aborted_load_leaves_the_device_cache_alone(ckpt: Path) -> None:
    engine, host = mirrored(ckpt)
    ids = prompt(40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("r", ids, params, import_tokens=32)
    assert drain(engine) == {}
    (load,) = engine.take_loads()
    host[load.block_ids] = 1.0
    engine.abort_request("r")
    engine.finish_load("r", 32)  # frees the blocks; a request that is gone gets no copy
    assert not bool((engine.runner.kv_cache == 1.0).any())
    assert engine.block_manager.num_used_blocks == 0


def test_the_mirror_is_off_on_the_cpu_unless_asked_and_needs_host_memory(ckpt: Path) -> None:
    region = torch.zeros(make_engine(ckpt).runner.kv_cache.shape)
    engine = make_engine(ckpt, device="cpu", kv_cache_factory=lambda shape, dtype: region)
    assert engine.mirror is None and engine.runner.kv_cache is region  # the region is the cache
    with pytest.raises(ValueError, match="kv_mirror needs a kv_cache_factory"):
        make_engine(ckpt, kv_mirror=True)
