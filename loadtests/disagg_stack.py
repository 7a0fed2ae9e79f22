"""A ``yutu up`` stack for the disaggregation benchmark: started in isolation, always stopped.

    with shm_directory(work) as shm, Stack(StackSpec(prefill=2, decode=1), work / "s1", shm) as stack:
        reply = stack.complete(ids, max_tokens=4)        # streamed, token-id prompt, client timing
        stack.records("prefill"), stack.admin_json("store-master", "store-master", "/stats")
        stack.metric("yutu_gateway_handoff_seconds_sum")

Isolation: its own redis-server on a free port (no persistence; its files in the work dir), a free
gateway port, ``--log-dir`` in the work dir, and region files in a private folder under /dev/shm
(``YUTU_SHM_DIR``, see :func:`shm_directory`). ``YUTU_*`` variables of the caller's environment
are not passed on, so a run is what its ``StackSpec`` says. Every way out of the ``with`` stops
yutu up (SIGTERM, SIGKILL after a grace period; it stops its own children) and then Redis; both
get SIGTERM from the kernel if the bench itself dies (``yutu.launcher``). Region files left after
a stack stopped are a bug of the system: :attr:`Stack.leftovers` names them, and they are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from yutu.launcher import Child, ChildSpec, ProcessGroup, free_port, start_redis
from yutu.transfer.region import SHM_DIR_ENV, pid_alive

READY_TIMEOUT_S = 300.0
BANNER_END = "Ctrl-C stops everything."
SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
SHM_PREFIX = "yutu-bench-"
VALUELESS = {"--prefill-stealing", "--no-prefill-stealing"}  # yutu up options that take no value


class StackError(Exception):
    """The stack misbehaved (did not start, answered an error, broke a promise): reported, not hidden."""


@dataclass(frozen=True)
class StackSpec:
    """One ``yutu up`` command line (the demo model)."""

    label: str  # names the stack in reports and its work dir
    prefill: int = 1
    decode: int = 1
    workers: int | None = None  # mixed workers instead of prefill/decode
    policy: str | None = None  # None: yutu up's default
    disagg_threshold: int | None = None  # None: yutu up's default
    torch_threads: int = 0
    prefill_threads: int = 0  # 0: yutu up's rule
    max_model_len: int = 4096
    kv_cache_memory_mib: int = 256
    store_segment_size: str = "512MiB"
    admin_token: str | None = None  # the conductor's: lets the bench change the policy at run time
    store_nodes: int | None = None  # None: yutu up's default
    engine_core: str | None = None  # None: yutu up's default (process)
    prefill_stealing: bool | None = None  # None: yutu up's default (on); False measures disaggregation alone

    def argv(self, port: int, redis_url: str, log_dir: Path) -> list[str]:
        argv = [sys.executable, "-m", "yutu.cli", "up", "--port", str(port), "--redis-url", redis_url,
                "--log-dir", str(log_dir), "--max-model-len", str(self.max_model_len),
                "--kv-cache-memory-mib", str(self.kv_cache_memory_mib),
                "--store-segment-size", self.store_segment_size, "--torch-threads", str(self.torch_threads),
                "--ready-timeout", str(READY_TIMEOUT_S), "--max-restarts", "0"]  # fmt: skip
        if self.prefill_threads:
            argv += ["--prefill-threads", str(self.prefill_threads)]
        if self.store_nodes is not None:
            argv += ["--store-nodes", str(self.store_nodes)]
        if self.engine_core is not None:
            argv += ["--engine-core", self.engine_core]
        if self.workers is not None:
            return [*argv, "--workers", str(self.workers)]
        argv += ["--prefill", str(self.prefill), "--decode", str(self.decode)]
        if self.policy is not None:
            argv += ["--policy", self.policy]
        if self.disagg_threshold is not None:
            argv += ["--disagg-threshold", str(self.disagg_threshold)]
        if self.admin_token is not None:
            argv += ["--admin-token", self.admin_token]
        if self.prefill_stealing is not None:
            argv.append("--prefill-stealing" if self.prefill_stealing else "--no-prefill-stealing")
        return argv

    @property
    def command(self) -> str:
        """The yutu up options, as a user would type them (ports and paths left out)."""
        argv = self.argv(0, "-", Path("-"))
        skip = {"--port", "--redis-url", "--log-dir", "--ready-timeout", "--max-restarts", "--admin-token"}
        flags = [a for a in argv[4:] if a in VALUELESS]
        pairs = [a for a in argv[4:] if a not in VALUELESS]
        shown = [f"{a} {b}" for a, b in zip(pairs[::2], pairs[1::2], strict=True) if a not in skip]
        return "yutu up " + " ".join(shown + flags)


@dataclass(frozen=True)
class Reply:
    """One streamed completion, timed by the client (seconds after the request was sent)."""

    prefill: str | None  # x-yutu-prefill ("none": the decode prefilled)
    decode: str | None  # x-yutu-decode
    token_times_s: list[float]  # one per generated token
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0]


@contextlib.contextmanager
def private_dir(root: Path, prefix: str, keep: bool = False) -> Iterator[Path]:
    """A new folder ``root/<prefix><pid>-<random>``, removed afterwards (``keep``: renamed to
    ``<prefix>kept-...`` instead). Folders of this kind whose process died (killed outright, so it
    could not clean up) are removed first."""
    for stale in root.glob(f"{prefix}*"):
        pid = stale.name.removeprefix(prefix).split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    path = root / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        if keep:
            path.rename(root / f"{prefix}kept-{path.name.removeprefix(prefix)}")
        else:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def shm_directory() -> Iterator[Path]:
    """A private folder under /dev/shm for region files: ``YUTU_SHM_DIR`` of this process and its
    children while it lasts (see :func:`private_dir`)."""
    previous = os.environ.get(SHM_DIR_ENV)
    with private_dir(SHM_ROOT, SHM_PREFIX) as path:
        os.environ[SHM_DIR_ENV] = str(path)
        try:
            yield path
        finally:
            if previous is None:
                os.environ.pop(SHM_DIR_ENV, None)
            else:
                os.environ[SHM_DIR_ENV] = previous


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, period_s: float = 0.05) -> float:
    """Poll ``cond`` until it holds; returns the seconds waited. StackError naming ``what`` on timeout."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise StackError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(period_s)
    return time.monotonic() - start


@dataclass
class Stack:
    """See the module docstring. Use as a context manager."""

    spec: StackSpec
    work: Path
    shm: Path
    model: str = ""  # the served model's name (/v1/models)
    vocab_size: int = 0  # from the served checkpoint's config.json
    url: str = ""
    leftovers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.group = ProcessGroup(self.work / "logs")
        self.redis_url = f"redis://127.0.0.1:{free_port()}/0"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(120.0, connect=10.0))
        self._redis = redis.Redis.from_url(self.redis_url)

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        start_redis(self.group, self.redis_url, self.work / "redis", persist=False)
        env = {k: v for k, v in os.environ.items() if not k.startswith("YUTU_")}
        env |= {SHM_DIR_ENV: str(self.shm), "PYTHONUNBUFFERED": "1"}
        argv = self.spec.argv(self.port, self.redis_url, self.work / "logs" / "stack")
        log = self.group.log_path("yutu-up")  # appended to: a stack started before in this work dir
        before = log.stat().st_size if log is not None and log.exists() else 0  # printed its banner there
        up = self.group.start(ChildSpec("yutu-up", tuple(argv), env))
        wait_for(
            lambda: self._banner_printed(up, before), READY_TIMEOUT_S, f"`{self.spec.command}` to be up", 0.2
        )
        wait_for(self._everyone_seen, 60, "the gateway and the conductor to see every instance", 0.1)
        card = self.http.get("/v1/models").json()["data"][0]
        self.model = str(card["id"])
        config = json.loads((Path(card["root"]) / "config.json").read_text())  # the served checkpoint
        self.vocab_size = int(config["vocab_size"])

    def _banner_printed(self, up: Child, since: int) -> bool:
        """Whether ``up`` printed its banner to its log past byte ``since`` (what this start wrote)."""
        if up.proc.poll() is not None:
            raise StackError(
                f"`{self.spec.command}` exited with code {up.proc.returncode}:\n{self.log_tail()}"
            )
        log = up.log_path
        if log is None or not log.exists():
            return False
        with log.open("rb") as f:
            f.seek(since)
            return BANNER_END.encode() in f.read()

    def _everyone_seen(self) -> bool:
        info = self.http.get("/info").json()
        if self.spec.workers is not None:
            return sum(w["live"] for w in info["workers"]) == self.spec.workers
        if sum(w["live"] for w in info["decode"]) != self.spec.decode:
            return False
        if sum(p["usable"] for p in info["prefill"]) != self.spec.prefill:
            return False
        view = self.admin_json("conductor", "conductor", "/instances")
        return sum(i["live"] for i in view["instances"]) == self.spec.prefill + self.spec.decode

    def close(self) -> None:
        """Stop yutu up (it stops its services), then Redis; note and remove region files left."""
        try:
            self.group.stop(grace_s=60.0)
        finally:
            self.http.close()
            self._redis.close()
            self.leftovers = sorted(p.name for p in self.shm.iterdir()) if self.shm.exists() else []
            for name in self.leftovers:
                with contextlib.suppress(OSError):
                    (self.shm / name).unlink()

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for log in sorted((self.work / "logs").rglob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.relative_to(self.work)}\n" + "\n".join(tail))
        return "\n".join(out)

    # -- the registry, the admin apps, the gateway's metrics -----------------------------------------

    def records(self, kind: str) -> dict[str, dict[str, Any]]:
        """Registry records of ``kind`` by instance id (yutu up's registry prefix, ``yutu``)."""
        out = {}
        for key in self._redis.scan_iter(f"yutu:svc:{kind}:*"):
            raw = self._redis.get(key)
            if raw is not None:
                record = json.loads(raw)
                out[record["instance_id"]] = record
        return out

    def admin_json(self, kind: str, instance: str, path: str) -> Any:
        record = self.records(kind).get(instance)
        if record is None:
            raise StackError(f"no {kind} {instance!r} in the registry")
        resp = httpx.get(record["endpoints"]["admin"] + path, timeout=10)
        if resp.status_code != 200:
            raise StackError(f"{kind} {instance} GET {path}: {resp.status_code} {resp.text[:300]}")
        return resp.json()

    def engine_instances(self) -> dict[str, str]:
        """instance id -> registry kind, of every engine process (prefill, decode, mixed worker)."""
        return {i: kind for kind in ("prefill", "decode", "worker") for i in self.records(kind)}

    def block_bytes(self) -> int:
        """Bytes of one KV block: every engine's registry meta must agree."""
        sizes = {i: r["meta"].get("block_bytes") for k in ("prefill", "decode", "worker")
                 for i, r in self.records(k).items()}  # fmt: skip
        if len(set(sizes.values())) != 1 or not all(isinstance(v, int) and v > 0 for v in sizes.values()):
            raise StackError(f"registry meta block_bytes disagree or are missing: {sizes}")
        return int(next(iter(sizes.values())))

    def metric(self, name: str) -> float:
        """The gateway's ``name`` from /metrics, summed over its label sets (0 if absent)."""
        total, found = 0.0, False
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found and not name.endswith(("_sum", "_count")):
            raise StackError(f"the gateway's /metrics has no {name}")
        return total

    def has_metric(self, name: str) -> bool:
        return f"# TYPE {name} " in self.http.get("/metrics").text

    # -- requests ---------------------------------------------------------------------------------

    def complete(self, ids: list[int], max_tokens: int) -> Reply:
        """A streamed greedy completion of token ids (``ignore_eos``, usage included), timed per token
        from the request's send; StackError with the server's answer for anything but a full stream."""
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        times: list[float] = []
        usage: dict[str, Any] | None = None
        sent = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise StackError(f"completion answered {resp.status_code}: {resp.read().decode()[:500]}")
            headers = resp.headers
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise StackError(f"error event in the stream: {event['error']}")
                for choice in event.get("choices", ()):
                    lp = choice.get("logprobs") or {}
                    times += [time.perf_counter() - sent] * len(lp.get("tokens") or ())
                usage = event.get("usage") or usage
        if usage is None or len(times) != max_tokens or usage.get("completion_tokens") != max_tokens:
            raise StackError(f"stream of {len(times)} tokens, usage {usage}: expected {max_tokens} tokens")
        return Reply(
            headers.get("x-yutu-prefill"),
            headers.get("x-yutu-decode"),
            times,
            int(usage["prompt_tokens"]),
            int(usage["completion_tokens"]),
            int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        )
