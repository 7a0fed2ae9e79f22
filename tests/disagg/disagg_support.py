"""A disaggregated stack for tests: real processes on loopback, a real Redis, a tiny real model.

:class:`DisaggStack` starts a store master and node, a conductor, prefill and decode instances and
a gateway (each a ``yutu`` subprocess, logs in a temp dir, region files in their own directory so
a leak is seen) and tears everything down checking what a user would: every worker's block pool
intact, no prefill hold left, no region file left. Helpers send OpenAI requests with token-id
prompts and read the ``x-yutu-*`` headers.

The conductor runs without prefill stealing (its default) unless a test asks for it
(test_disagg_stealing.py).
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import torch
from yutu.engine.engine import EngineConfig, LLMEngine
from yutu.engine.sampling import SamplingParams
from yutu.launcher import ADMIN_PORT, Child, ChildSpec, ProcessGroup, free_port, python_module
from yutu.transfer.region import sweep_stale_region_files

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
VOCAB = 512
MODEL_NAME = "tiny"


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]
    tokens: list[int] = field(default_factory=list)  # streamed token ids (logprobs carry them)
    logprobs: list[float] = field(default_factory=list)

    @property
    def text(self) -> str:
        return str(self.body["choices"][0]["text"])

    @property
    def cached(self) -> int:
        return int(self.body["usage"]["prompt_tokens_details"]["cached_tokens"])


class DisaggStack:
    """See the module docstring. Use as a context manager."""

    def __init__(
        self,
        tmp: Path,
        model: Path,
        redis_url: str,
        *,
        prefill: int = 1,
        decode: int = 1,
        mixed: int = 0,
        store: bool = True,
        conductor: bool = True,
        policy: str = "kvcentric",
        disagg_threshold: int = 0,
        prefill_stealing: bool = False,
        conductor_flags: tuple[str, ...] = (),
        worker_flags: tuple[str, ...] = (),
        gateway_flags: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tmp
        self.model = model
        self.redis_url = redis_url
        self.prefix = f"yutu-dg-{uuid.uuid4().hex[:8]}"
        self.shm_dir = tmp / "shm"
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.group = ProcessGroup(tmp / "logs")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "YUTU_SHM_DIR": str(self.shm_dir),
        }
        self.specs: dict[str, ChildSpec] = {}
        self.killed_pids: list[int] = []
        common = ("--redis-url", redis_url, "--registry-prefix", self.prefix, "--registry-ttl", "3")
        model_flags = ("--model", str(model), "--served-model-name", MODEL_NAME)
        engine = (
            *model_flags,
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--num-kv-blocks",
            "512",
            "--torch-threads",
            "1",
            "--dtype",
            "float32",
            *worker_flags,
        )  # fmt: skip -- float32: outputs are compared token for token
        if store:
            self._add("store-master", "store-master", *common)
            self._add("store-node-0", "store-node", "--segment-size", "64MiB", *common)
        if conductor:
            stealing = "--prefill-stealing" if prefill_stealing else "--no-prefill-stealing"
            self._add("conductor", "conductor", "--policy", policy, "--disagg-threshold", str(disagg_threshold), stealing,
                      "--block-size", str(BLOCK_SIZE), "--report-stale", "3", *conductor_flags, *common)  # fmt: skip
        for i in range(prefill):
            self._add(f"prefill-{i}", "prefill", *engine, *common)
        for i in range(decode):
            self._add(f"decode-{i}", "decode", *engine, *common)
        for i in range(mixed):
            self._add(f"worker-{i}", "worker", *engine, *common)
        gateway = python_module("yutu.cli", "gateway", *model_flags, "--port", str(self.port), "--instance-id", "gateway",
                                "--worker-liveness-timeout", "3", "--registry-poll", "0.3", *common,
                                *gateway_flags)  # fmt: skip
        self.specs["gateway"] = ChildSpec("gateway", tuple(gateway), self.env, f"{self.url}/ready")

    def _add(self, name: str, command: str, *flags: str) -> None:
        argv = python_module("yutu.cli", command, "--instance-id", name, "--admin-port", ADMIN_PORT, *flags)
        self.specs[name] = ChildSpec(name, tuple(argv), self.env, f"http://127.0.0.1:{ADMIN_PORT}/ready")

    # -- lifecycle -----------------------------------------------------------------------------------

    def __enter__(self) -> DisaggStack:
        try:
            for spec in self.specs.values():
                self.group.start(spec)
            self.group.wait_ready(180)
            self.wait_for(lambda: self._gateway_sees_everyone(), 30, "the gateway to see every instance")
            if "conductor" in self.specs:
                self.wait_for(self._conductor_sees_everyone, 30, "the conductor to see every instance")
        except BaseException:
            self.dump_logs()
            self.group.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                self.check_clean()
        except BaseException:
            self.dump_logs()
            raise
        finally:
            self.group.stop()
        # A SIGKILLed instance cannot unlink its regions; the next start of any service reclaims
        # them (as yutu up does at start). Anything else left is a leak.
        killed = {str(pid) for pid in self.killed_pids}
        leftover = sorted(p.name for p in self.shm_dir.iterdir())
        leaked = [name for name in leftover if name.split("-")[2] not in killed]
        assert not leaked, f"region files left behind after the stack stopped: {leaked}"
        sweep_stale_region_files(str(self.shm_dir))
        assert not list(self.shm_dir.iterdir()), "the killed instances' regions were not reclaimed"

    def dump_logs(self) -> None:
        for log in sorted((self.tmp / "logs").glob("*.log")):
            sys.stderr.write(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}\n")

    @staticmethod
    def wait_for(cond: Any, timeout_s: float, what: str) -> None:
        """Poll ``cond`` until true; a record not (yet) in the registry or an admin app not answering
        counts as not yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if cond():
                    return
            except (KeyError, httpx.HTTPError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def child(self, name: str) -> Child:
        return next(c for c in self.group.children if c.spec.name == name)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        proc = self.child(name).proc
        proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.killed_pids.append(proc.pid)
            proc.wait(10)

    def restart(self, name: str) -> None:
        self.group.children = [c for c in self.group.children if c.spec.name != name]
        self.group.start(self.specs[name])
        self.group.wait_ready(120)

    # -- the registry and the admin apps --------------------------------------------------------------

    def records(self, kind: str) -> dict[str, dict[str, Any]]:
        client = redis.Redis.from_url(self.redis_url)
        try:
            out = {}
            for key in client.scan_iter(f"{self.prefix}:svc:{kind}:*"):
                raw = client.get(key)
                if raw is not None:
                    record = json.loads(raw)
                    out[record["instance_id"]] = record
            return out
        finally:
            client.close()

    def admin(self, kind: str, name: str) -> str:
        return str(self.records(kind)[name]["endpoints"]["admin"])

    def get(self, kind: str, name: str, path: str) -> Any:
        return httpx.get(self.admin(kind, name) + path, timeout=10).json()

    def _gateway_sees_everyone(self) -> bool:
        try:
            info = httpx.get(f"{self.url}/info", timeout=5).json()
        except httpx.HTTPError:
            return False
        want_d = sum(1 for n in self.specs if n.startswith("decode-"))
        want_p = sum(1 for n in self.specs if n.startswith("prefill-"))
        want_w = sum(1 for n in self.specs if n.startswith("worker-"))
        return (
            sum(1 for w in info["decode"] if w["live"]) == want_d
            and sum(1 for p in info["prefill"] if p["usable"]) == want_p
            and sum(1 for w in info["workers"] if w["live"]) == want_w
        )

    def _conductor_sees_everyone(self) -> bool:
        try:
            view = self.get("conductor", "conductor", "/instances")
        except (httpx.HTTPError, KeyError):
            return False
        want = {n for n in self.specs if n.startswith(("prefill-", "decode-"))}
        return {i["instance_id"] for i in view["instances"] if i["live"]} == want

    def check_clean(self) -> None:
        """Every worker idle with an intact block pool, no prefill hold left, write-behind drained."""
        for name in self.specs:
            if not name.startswith(("prefill-", "decode-", "worker-")):
                continue
            kind = "worker" if name.startswith("worker-") else name.split("-")[0]
            if self.child(name).proc.poll() is not None:
                continue  # killed by the test
            admin = self.admin(kind, name)

            last: dict[str, Any] = {}

            def idle(admin: str = admin, last: dict[str, Any] = last) -> bool:
                info = httpx.get(admin + "/info", timeout=10).json()
                last["info"] = info
                wb = info.get("write_behind") or {"in_flight": 0}
                return info["in_flight"] == 0 and wb["in_flight"] == 0 and info["engine"]["num_loading"] == 0

            try:
                self.wait_for(idle, 30, f"{name} to be idle")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; its last /info: {last.get('info')}") from None
            check = httpx.post(admin + "/debug/check_integrity", timeout=10)
            assert check.status_code == 200, f"{name}: block pool integrity: {check.text}"
            assert check.json()["held"] == 0, f"{name}: prefill holds left: {check.json()}"
            assert check.json()["used_blocks"] == 0, f"{name}: blocks still in use: {check.json()}"
        if "store-master" in self.specs and self.child("store-master").proc.poll() is None:
            check = httpx.post(
                self.admin("store-master", "store-master") + "/debug/check_integrity", timeout=10
            )
            assert check.status_code == 200, f"store metadata: {check.text}"

    # -- requests ----------------------------------------------------------------------------------

    def reference(self, ids: list[int], max_tokens: int, **params: Any) -> list[int]:
        """The greedy tokens of a cold run of ``ids`` on an engine in this process (same model);
        ``params``: more SamplingParams fields."""
        return reference_tokens(self.model, ids, max_tokens, **params)

    def complete(self, ids: list[int], max_tokens: int = 8, stream: bool = False, **extra: Any) -> Reply:
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": stream, "return_tokens_as_token_ids": True,
                **extra}  # fmt: skip
        if stream:
            body["stream_options"] = {"include_usage": True}
            return self._stream(body)
        resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        payload = resp.json()
        reply = Reply(resp.status_code, dict(resp.headers), payload)
        if resp.status_code == 200:
            lp = payload["choices"][0]["logprobs"]
            reply.tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]] if lp else []
            reply.logprobs = lp["token_logprobs"] if lp else []
        return reply

    def burst(
        self, prompts: list[list[int]], max_tokens: int, extras: list[dict[str, Any]] | None = None
    ) -> list[Reply]:
        """Send every prompt at once (non-streamed; ``extras``: more fields for each request's body)
        and return the replies in order.

        Like many remote clients, not one busy local one: bodies are encoded up front and one
        connection pool serves every thread, so the client's own CPU (a fresh ``httpx`` client per
        request costs more than the gateway does) does not slow the servers sharing these cores.
        """
        bodies = [
            json.dumps({"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, **extra}).encode()
            for ids, extra in zip(prompts, extras or [{}] * len(prompts), strict=True)
        ]  # fmt: skip
        headers = {"content-type": "application/json"}
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
        with httpx.Client(limits=limits, timeout=120) as client, ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(
                pool.map(
                    lambda b: client.post(f"{self.url}/v1/completions", content=b, headers=headers), bodies
                )
            )
        return [Reply(r.status_code, dict(r.headers), r.json()) for r in responses]

    def _stream(self, body: dict[str, Any]) -> Reply:
        tokens: list[int] = []
        logprobs: list[float] = []
        text = ""
        usage: dict[str, Any] = {}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as resp:
            if resp.status_code != 200:
                resp.read()
                return Reply(resp.status_code, dict(resp.headers), resp.json())
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event["choices"]:
                    text += choice["text"]
                    lp = choice.get("logprobs")
                    if lp:
                        tokens += [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
                        logprobs += lp["token_logprobs"]
            headers = dict(resp.headers)
        return Reply(200, headers, {"choices": [{"text": text}], "usage": usage}, tokens, logprobs)


@functools.lru_cache(maxsize=2)
def _engine(model: Path) -> LLMEngine:
    torch.set_num_threads(1)
    return LLMEngine(EngineConfig(model, device="cpu", dtype="float32", num_kv_blocks=512,
                                  max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False))  # fmt: skip


def reference_tokens(model: Path, ids: list[int], max_tokens: int, **params: Any) -> list[int]:
    engine = _engine(model)
    rid = uuid.uuid4().hex
    engine.add_request(
        rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    )
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def stack(tmp: Path, model: Path, redis_url: str, **kw: Any) -> Iterator[DisaggStack]:
    with DisaggStack(tmp, model, redis_url, **kw) as s:
        yield s
