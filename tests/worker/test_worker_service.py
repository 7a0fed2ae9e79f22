"""The worker as a real process: generate channel over TCP, registry record, aborts, drain."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from worker_support import Dealer
from yutu.busypoll import SPIN_US
from yutu.engine.engine import EngineConfig, LLMEngine
from yutu.engine.sampling import SamplingParams
from yutu.engine.testing import make_tiny_checkpoint
from yutu.protocol.generate import (
    AbortRequest,
    GenerateRequest,
    KVReady,
    RequestFailed,
    TokenDelta,
    TokenDeltas,
)
from yutu.protocol.prefill import KVHandle
from yutu.registry import Registry
from yutu.transfer.region import sweep_stale_region_files

PROMPT = [5, 9, 23, 42, 7, 7, 81, 3, 64, 11, 2, 19, 33, 48, 90, 101, 17, 4]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", arch="llama", seed=3)


@pytest.fixture(scope="module", params=["process", "thread"])
def worker(checkpoint: Path, redis_url: str, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """A worker with its engine core in a child process (the default) or on a thread (the plain
    reference): every test of this module runs against both, to the same expected tokens."""
    prefix = f"yutu-worker-test-{request.param}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.worker.main", "--model", str(checkpoint), "--redis-url", redis_url,
         "--registry-prefix", prefix, "--instance-id", "w-test", "--num-kv-blocks", "128", "--block-size", "4",
         "--torch-threads", "1", "--dtype", "float32", "--log-level", "warning", "--engine-core", request.param,
         # the thread core's worker also sleeps at once on its transfers (yutu.busypoll) and keeps the
         # host's congestion control on its data connections: same tokens
         *(["--busy-poll-us", "0", "--tcp-congestion", "system"] if request.param == "thread" else [])],
    )  # fmt: skip
    try:
        record = asyncio.run(_wait_registered(redis_url, prefix, proc))
        yield {**record, "prefix": prefix, "core": request.param}
    finally:
        stop_worker(proc)


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the worker drains and removes its KV region file), SIGKILL if it hangs, and then
    whatever region file a killed worker left is swept: nothing stays in /dev/shm."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    sweep_stale_region_files()


async def _wait_registered(redis_url: str, prefix: str, proc: subprocess.Popen[bytes]) -> dict[str, str]:
    registry = Registry.from_url(redis_url, prefix)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "worker exited during start-up"
            record = await registry.get("worker", "w-test")
            if record is not None:
                return record.endpoints
            await asyncio.sleep(0.2)
    finally:
        await registry.close()
    raise TimeoutError("worker did not register")


@pytest.fixture
async def dealer(worker: dict[str, str]) -> AsyncIterator[Dealer]:
    front_end = Dealer(worker["generate"])
    yield front_end
    front_end.close()


async def collect(sock: Dealer, request_id: str, timeout_s: float = 60) -> list[TokenDelta | RequestFailed]:
    msgs: list[TokenDelta | RequestFailed] = []
    while True:
        msg = await sock.recv(timeout_s)
        assert msg.request_id == request_id
        msgs.append(msg)
        if isinstance(msg, RequestFailed) or msg.finish_reason is not None:
            return msgs


def reference_tokens(checkpoint: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model_dir=checkpoint, dtype="float32", num_kv_blocks=64, block_size=4))
    engine.add_request("ref", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


async def test_generate_streams_the_engine_tokens(checkpoint: Path, dealer: Dealer) -> None:
    params = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": 2}
    dealer.send(GenerateRequest("g1", PROMPT, params, time.time()))
    msgs = await collect(dealer, "g1")
    deltas = [m for m in msgs if isinstance(m, TokenDelta)]
    assert len(deltas) == len(msgs)
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == reference_tokens(
        checkpoint, PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    assert deltas[-1].finish_reason == "length"
    assert deltas[0].num_prompt_tokens == len(PROMPT)
    entries = [e for d in deltas for e in (d.logprobs or [])]
    assert [e[0] for e in entries] == tokens
    for token_id, logprob, top in entries:
        assert len(top) == 2 and top[0][0] == token_id and top[0][1] == pytest.approx(logprob)

    # The same prompt again: its full blocks (4 tokens each) come from the prefix cache.
    dealer.send(GenerateRequest("g2", PROMPT, params, time.time()))
    again = [m for m in await collect(dealer, "g2") if isinstance(m, TokenDelta)]
    assert [t for d in again for t in d.token_ids] == tokens
    assert again[0].num_cached_tokens == 16  # 18 tokens: 4 full blocks, the last token is always computed


async def test_one_front_ends_concurrent_requests_share_a_frame_per_step(
    checkpoint: Path, dealer: Dealer
) -> None:
    params = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}  # long enough to overlap
    prompts = {f"b{i}": PROMPT[: 6 + 3 * i] for i in range(3)}
    for rid, ids in prompts.items():
        dealer.send(GenerateRequest(rid, ids, params, time.time()))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    batched: list[set[str]] = []
    done: set[str] = set()
    while done != set(prompts):
        msg = await dealer.recv(60)
        deltas = msg.unpack() if isinstance(msg, TokenDeltas) else [msg]
        if isinstance(msg, TokenDeltas):
            batched.append({d.request_id for d in deltas})
        for d in deltas:
            assert isinstance(d, TokenDelta), d
            tokens[d.request_id] += d.token_ids
            if d.finish_reason is not None:
                done.add(d.request_id)
    assert batched and max(len(ids) for ids in batched) >= 2  # requests decoded in one step share a frame
    reference = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for rid, ids in prompts.items():
        assert tokens[rid] == reference_tokens(checkpoint, ids, reference), rid


@pytest.mark.parametrize(
    ("prompt", "sampling", "kind", "needle"),
    [
        ([], {}, "invalid_request_error", "non-empty list of token ids"),
        ([1, 10**9], {}, "invalid_request_error", "token ids in [0,"),
        ([1, -1], {}, "invalid_request_error", "token ids in [0,"),
        ([1, True], {}, "invalid_request_error", "token ids in [0,"),
        ([1, 2.0], {}, "invalid_request_error", "token ids in [0,"),
        ([1, "2"], {}, "invalid_request_error", "token ids in [0,"),
        ([1, 2], {"temperature": -1.0}, "invalid_request_error", "temperature"),
        ([1, 2], {"bogus": 1}, "invalid_request_error", "bogus"),
        (list(range(1, 200)) * 20, {"max_tokens": 4}, "invalid_request_error", "maximum context length"),
    ],
)
async def test_bad_requests_fail_with_their_kind(
    dealer: Dealer, prompt: list[int], sampling: dict[str, object], kind: str, needle: str
) -> None:
    dealer.send(GenerateRequest("bad", prompt, sampling, time.time()))
    (msg,) = await collect(dealer, "bad")
    assert isinstance(msg, RequestFailed)
    assert msg.kind == kind and needle in msg.message


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
async def test_a_bad_cache_salt_fails_the_request(dealer: Dealer, salt: object) -> None:
    dealer.send(GenerateRequest("salted", PROMPT, {"max_tokens": 2}, time.time(), cache_salt=salt))  # type: ignore[arg-type]
    (msg,) = await collect(dealer, "salted")
    assert isinstance(msg, RequestFailed)
    assert msg.kind == "invalid_request_error" and "cache_salt" in msg.message


async def test_abort_and_vanished_front_end_free_blocks(worker: dict[str, str], dealer: Dealer) -> None:
    params = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}  # 54 + 400 tokens fit in 512
    long_prompt = PROMPT * 3
    dealer.send(GenerateRequest("long", long_prompt, params, time.time()))
    first = await dealer.recv(60)
    assert isinstance(first, TokenDelta) and first.token_ids
    dealer.send(AbortRequest("long"))
    await _wait_idle(worker["admin"])
    received = len(first.token_ids)
    while (late := await dealer.recv_within(0.2)) is not None:  # deltas in flight when the abort landed
        assert isinstance(late, TokenDelta) and late.finish_reason is None
        received += len(late.token_ids)
    assert received < 400  # stopped by the abort, not by max_tokens

    # A front end that disappears without aborting: the worker notices when it cannot route a reply.
    other = Dealer(worker["generate"])
    other.send(GenerateRequest("orphan", long_prompt, params, time.time()))
    await other.recv(60)
    other.close()
    await _wait_idle(worker["admin"])
    async with httpx.AsyncClient() as http:
        assert (await http.post(worker["admin"] + "/debug/check_integrity")).json()["ok"] is True


async def test_a_request_told_early_waits_for_its_kv_and_a_kv_ready_it_cannot_use_fails_it(
    worker: dict[str, str], dealer: Dealer
) -> None:
    """``await_kv``: admitted at once, its blocks taken, nothing computed until KVReady. A KVReady
    that does not fit the request fails it (invalid_request_error) and frees its blocks; one for a request
    that is not there is ignored."""
    params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    handle = KVHandle("p-0", "p-req", "tcp://127.0.0.1:9", "seg", "kv", [1, 2, 3], 10, 1024, 5.0, "tiny")
    async with httpx.AsyncClient() as http:
        for rid, ready, needle in [
            ("early-1", KVReady("early-1", 5, ["not", "a", "handle"]), "malformed KV handle"),
            ("early-2", KVReady("early-2", 5, handle.to_wire()), "the KV handle holds 10 tokens, the prompt has 18"),
            ("early-3", KVReady("early-3", -1, handle.to_wire()), "token -1 is not a token id of this model"),
        ]:  # fmt: skip
            dealer.send(GenerateRequest(rid, PROMPT, params, time.time(), await_kv=True))
            deadline = time.monotonic() + 30
            while (await http.get(worker["admin"] + "/info")).json()["engine"]["num_loading"] != 1:
                assert time.monotonic() < deadline, "the request told early was not admitted"
                await asyncio.sleep(0.05)
            assert await dealer.recv_within(0.2) is None  # it waits for its KV: no token
            dealer.send(KVReady("nobody", 5, handle.to_wire()))  # not here: ignored
            dealer.send(ready)
            (msg,) = await collect(dealer, rid)
            assert (
                isinstance(msg, RequestFailed)
                and msg.kind == "invalid_request_error"
                and needle in msg.message
            )
            await _wait_idle(worker["admin"])
            info = (await http.get(worker["admin"] + "/info")).json()
            assert info["engine"]["num_loading"] == 0 and info["imports"]["awaits_dropped"] >= 1
            assert (await http.post(worker["admin"] + "/debug/check_integrity")).json()["used_blocks"] == 0


async def _wait_idle(admin: str) -> None:
    async with httpx.AsyncClient() as http:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = (await http.get(admin + "/info")).json()
            if (
                info["in_flight"] == 0
                and info["engine"]["num_running"] == 0
                and info["engine"]["num_waiting"] == 0
            ):
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"worker still busy: {info}")


async def test_admin_endpoints_and_registry_meta(
    worker: dict[str, str], redis_url: str, checkpoint: Path
) -> None:
    async with httpx.AsyncClient() as http:
        assert (await http.get(worker["admin"] + "/health")).json() == {"status": "ok"}
        assert (await http.get(worker["admin"] + "/ready")).status_code == 200
        metrics = (await http.get(worker["admin"] + "/metrics")).text
        info = (await http.get(worker["admin"] + "/info")).json()
    for name in (
        "yutu_worker_kv_cache_usage_perc",
        "yutu_worker_prefix_cache_hits_total",
        "yutu_worker_prefix_cache_queries_total",
        "yutu_worker_num_requests_running",
        "yutu_worker_num_requests_waiting",
        "yutu_worker_num_preemptions_total",
        "yutu_worker_generation_tokens_total",
        "# TYPE yutu_gc_pause_seconds histogram",  # this process's collections (yutu.gcpauses)
    ):
        assert name in metrics
    # The engine process's collections come to the worker's metrics too; its start-up heap is frozen.
    assert ("# TYPE yutu_engine_gc_pause_seconds histogram" in metrics) == (worker["core"] == "process")
    assert info["gc_frozen_objects"] > 10_000  # torch, FastAPI, ...: out of every collection's walk
    if worker["core"] == "process":
        assert info["engine_gc_frozen_objects"] > 10_000
    else:
        assert info["engine_gc_frozen_objects"] is None  # the worker's own count covers its engine
    assert info["model"] == checkpoint.name and info["block_size"] == 4 and info["demo"] is False
    assert info["engine_core"] == worker["core"] and info["torch_threads"] == 1
    assert info["busy_poll_us"] == (0 if worker["core"] == "thread" else SPIN_US)
    assert info["tcp_congestion"] == ("system" if worker["core"] == "thread" else "reno")
    assert (info["engine_pid"] is not None) == (worker["core"] == "process")
    registry = Registry.from_url(redis_url, worker["prefix"])
    record = await registry.get("worker", "w-test")
    await registry.close()
    assert record is not None
    assert record.meta["model"] == checkpoint.name and record.meta["block_size"] == 4
    assert record.meta["max_model_len"] == info["max_model_len"]


def test_sigterm_drains_and_deregisters(checkpoint: Path, redis_url: str) -> None:
    prefix = "yutu-worker-drain"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.worker.main", "--model", str(checkpoint), "--redis-url", redis_url,
         "--registry-prefix", prefix, "--instance-id", "w-drain", "--num-kv-blocks", "32", "--block-size", "4",
         "--torch-threads", "1", "--log-level", "warning"],
    )  # fmt: skip
    try:
        asyncio.run(_wait_registered_named(redis_url, prefix, "w-drain", proc))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        registry = Registry.from_url(redis_url, prefix)
        assert asyncio.run(_list_and_close(registry)) == []
    finally:
        stop_worker(proc)


async def _wait_registered_named(
    redis_url: str, prefix: str, name: str, proc: subprocess.Popen[bytes]
) -> None:
    registry = Registry.from_url(redis_url, prefix)
    try:
        for _ in range(600):
            assert proc.poll() is None
            if await registry.get("worker", name) is not None:
                return
            await asyncio.sleep(0.2)
    finally:
        await registry.close()
    raise TimeoutError


async def _list_and_close(registry: Registry) -> list[object]:
    try:
        return list(await registry.list("worker"))
    finally:
        await registry.close()
