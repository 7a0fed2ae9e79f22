"""`yutu up` as a user runs it: one command starts Redis, a worker and the gateway; SIGINT stops all."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from yutu.engine.loader import auto_dtype
from yutu.engine.testing import make_tiny_checkpoint
from yutu.launcher import free_port, redis_reachable
from yutu.store.client import StoreClient, StoreClientConfig

AUTO_DTYPE = str(auto_dtype(torch.device("cpu"))).removeprefix("torch.")  # what `yutu up` runs here


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose (its parent has not reaped it yet)
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def read_until(proc: subprocess.Popen[bytes], needle: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout_s
    while needle.encode() not in seen:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"`yutu up` did not print {needle!r} (exit {proc.poll()}); output:\n{seen.decode()}"
            )
        if select.select([fd], [], [], 0.5)[0]:
            seen += os.read(fd, 65536)
    return seen.decode()


async def store_roundtrip(redis_url: str, payload: bytes) -> bytes:
    async with StoreClient(StoreClientConfig(redis_url)) as store:  # finds the master in the registry
        await store.put("yutu-up-test", payload)
        return await store.get("yutu-up-test")


def test_up_serves_and_stops_cleanly(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-up", arch="llama", seed=5)
    port, redis_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    assert not redis_reachable(redis_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "yutu.cli", "up", "--model", str(checkpoint), "--port", str(port),
         "--redis-url", redis_url, "--redis-dir", str(tmp_path / "redis"), "--log-dir", str(tmp_path / "logs"),
         "--kv-cache-memory-mib", "64", "--store-segment-size", "32MiB", "--api-key", "sekrit-key", "--log-format", "json",
         "--no-prefill-stealing"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        banner = read_until(proc, "Ctrl-C stops everything", timeout_s=240)
        assert f"Yutu is up: http://127.0.0.1:{port}/v1" in banner
        assert "demo model" not in banner  # a real checkpoint was given
        children = children_of(proc.pid)
        # redis-server, store-master, store-node-0, conductor, prefill-0, decode-0, gateway
        assert len(children) == 7
        assert redis_reachable(redis_url)
        assert (tmp_path / "redis" / "appendonlydir").is_dir()  # --redis-dir, not ~/.cache/yutu/redis

        for pid in children:  # the key reaches the gateway through its environment, not its argv
            assert b"sekrit-key" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0
            ).models.list()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekrit-key")
        assert [m.id for m in client.models.list().data] == ["tiny-up"]
        completion = client.completions.create(
            model="tiny-up", prompt="hello world", max_tokens=5, temperature=0
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 5

        traced = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                            headers={"Authorization": "Bearer sekrit-key", "x-request-id": "trace-me-1"},
                            json={"model": "tiny-up", "prompt": "hi", "max_tokens": 2})  # fmt: skip
        assert traced.status_code == 200 and traced.headers["x-request-id"] == "trace-me-1"
        info = httpx.get(
            f"http://127.0.0.1:{port}/info", timeout=10
        )  # version, uptime, config, secrets hidden
        assert info.status_code == 200 and "sekrit-key" not in info.text
        body = info.json()
        assert (
            body["version"] == "0.1.0" and body["uptime_s"] > 0 and body["config"]["api_keys"] == "<redacted>"
        )
        assert body["config"]["port"] == port
        docs = httpx.get(
            f"http://127.0.0.1:{port}/docs", headers={"Authorization": "Bearer sekrit-key"}, timeout=10
        )
        assert docs.status_code == 200 and "swagger" in docs.text.lower()  # OpenAPI docs on every service

        payload = os.urandom(100_000)
        assert asyncio.run(store_roundtrip(redis_url, payload)) == payload

        # `yutu status` shows the whole deployment: every instance ready, with its load
        status = subprocess.run([sys.executable, "-m", "yutu.cli", "status", "--redis-url", redis_url, "--json"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert status.returncode == 0, status.stderr
        rows = {(r["kind"], r["instance_id"]): r for r in json.loads(status.stdout)}
        kinds = sorted(kind for kind, _ in rows)
        assert kinds == ["conductor", "decode", "gateway", "prefill", "store-master", "store-node"], rows
        assert all(r["ready"] == "yes" for r in rows.values()), rows
        decode = rows[("decode", "decode-0")]["load"]
        assert decode["num_running"] == 0 and decode["dtype"] == AUTO_DTYPE and 0 <= decode["kv_usage"] <= 1
        master = rows[("store-master", "store-master")]["load"]
        assert master["objects"] >= 1 and master["capacity"] == 32 * 2**20  # the round trip's object
        conductor = rows[("conductor", "conductor")]["load"]
        assert conductor["policy"] == "kvcentric" and conductor["prefill_stealing"] is False  # passed on
        table = subprocess.run([sys.executable, "-m", "yutu.cli", "status", "--redis-url", redis_url],
                               capture_output=True, text=True, timeout=60).stdout  # fmt: skip
        assert table.splitlines()[0].split() == ["KIND", "INSTANCE", "READY", "ENDPOINT", "LOAD"]
        assert any(line.startswith("decode") and "num_running 0" in line for line in table.splitlines())

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(c) for c in children)
        assert not redis_reachable(redis_url)
        # --log-format json reached every service: each line of each log is one JSON object, and
        # the gateway named the traced request by its x-request-id
        lines = {log.stem: [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
                 for log in (tmp_path / "logs").glob("*.log") if log.stem != "redis"}  # fmt: skip
        assert {"gateway", "conductor", "prefill-0", "decode-0", "store-master", "store-node-0"} <= set(lines)
        assert all(
            {"ts", "level", "logger", "pid", "message"} <= set(entry)
            for log in lines.values()
            for entry in log
        )
        named = [e for e in lines["gateway"] if e.get("request_id") == "trace-me-1"]
        assert any(str(e["message"]).startswith("request cmpl-") for e in named), lines["gateway"][-10:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_up_killed_takes_its_children_down(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-kill", arch="llama", seed=6)
    port, redis_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "yutu.cli", "up", "--model", str(checkpoint), "--port", str(port),
         "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--redis-dir", str(tmp_path / "redis"),
         "--log-dir", str(tmp_path / "logs"), "--kv-cache-memory-mib", "64", "--store-nodes", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        read_until(proc, "Ctrl-C stops everything", timeout_s=240)
        children = children_of(proc.pid)
        assert len(children) == 5  # redis-server, conductor, prefill-0, decode-0, gateway: no store
        proc.kill()  # no chance to clean up: the children must notice on their own
        proc.wait()
        deadline = time.monotonic() + 30
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(c) for c in children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_up_help_lists_options_with_env_vars() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "yutu.cli", "up", "--help"], capture_output=True, text=True, check=True
    )
    for flag, env in (("--model", "YUTU_MODEL"), ("--port", "YUTU_PORT"), ("--redis-url", "YUTU_REDIS_URL")):
        assert flag in out.stdout and env in out.stdout


@pytest.mark.parametrize("command", ["gateway", "worker", "store-master", "store-node"])
def test_every_service_has_help(command: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "yutu.cli", command, "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "--redis-url" in out.stdout and "YUTU_REDIS_URL" in out.stdout


def startup_failure(*argv: str) -> str:
    """Run ``yutu <argv>``, which must fail to start as a user's mistake, not a crash: exit 1 and
    one log line saying why (no traceback); returns its stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "yutu.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out.stderr


@pytest.mark.parametrize("command", [["gateway", "--port", "0"], ["prefill"], ["decode"]])
def test_a_service_whose_model_is_missing_says_so_and_exits(command: list[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    stderr = startup_failure(*command, "--model", str(missing))
    assert f"cannot start: model directory {missing} does not exist" in stderr


def test_a_worker_whose_checkpoint_the_engine_cannot_run_says_so_and_exits(
    tmp_path: Path, redis_url: str
) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    stderr = startup_failure(
        "prefill", "--model", str(tmp_path), "--kv-cache-memory-mib", "16", "--redis-url", redis_url,
        "--registry-prefix", "bad-checkpoint",
    )  # fmt: skip
    assert (
        f"cannot start: the engine cannot serve {tmp_path}: architecture 'GPT2LMHeadModel' is not supported"
        in stderr
    )


@pytest.mark.parametrize("command", ["conductor", "store-master"])
def test_a_service_without_redis_says_so_and_exits(command: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    stderr = startup_failure(command, "--redis-url", url, "--port", "0", "--admin-port", "0")
    assert (
        "cannot start: Redis does not answer (Error 111 connecting to" in stderr and "--redis-url" in stderr
    )


def test_a_service_whose_port_is_taken_says_so_and_exits() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stderr = startup_failure("gateway", "--port", str(port))
    assert f"cannot start: cannot bind 127.0.0.1:{port}: Address already in use; pick another port" in stderr


def test_env_names_are_scoped_per_service() -> None:
    def help_of(command: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "yutu.cli", command, "--help"], capture_output=True, text=True
        )
        return " ".join(out.stdout.split())  # argparse wraps lines

    gateway, worker, master, node = (help_of(c) for c in ("gateway", "worker", "store-master", "store-node"))
    assert "YUTU_GATEWAY_PORT" in gateway and "YUTU_PORT;" not in gateway
    assert "YUTU_WORKER_ADMIN_PORT" in worker and "YUTU_WORKER_MAX_MODEL_LEN" in worker
    assert "YUTU_STORE_MASTER_PORT" in master and "YUTU_PORT;" not in master
    assert "YUTU_STORE_NODE_SEGMENT_SIZE" in node
    for text in (gateway, worker):  # shared by every service that takes them
        assert "YUTU_MODEL;" in text
    for text in (gateway, worker, master, node):
        assert "YUTU_REDIS_URL;" in text and "YUTU_REGISTRY_PREFIX;" in text


@pytest.mark.parametrize(
    ("engines", "cpus", "threads"),
    [
        (1, 2, 1),  # one mixed worker on 2 cores: a core left to the front ends (README, "Engines and CPUs")
        (2, 2, 1),  # 1 prefill + 1 decode on 2 cores: at least one thread each (oversubscribed, not idle)
        (1, 16, 15),
        (2, 16, 7),  # 1P+1D on 16 cores: 15 shared
        (4, 16, 3),
        (3, 1, 1),
    ],
)
def test_torch_threads_per_engine_follow_the_documented_rule(engines: int, cpus: int, threads: int) -> None:
    from yutu.cli import engine_threads

    assert engine_threads(engines, cpus) == threads


@pytest.mark.parametrize(
    ("torch_threads", "cpus", "threads"),
    [
        (
            1,
            2,
            2,
        ),  # one mixed worker, or 1 prefill + 1 decode, on 2 cores: a long prompt's chunk may take both
        (15, 16, 16),
        (7, 16, 16),
        (1, 1, 1),
        (4, 2, 4),  # --torch-threads 4 given: never fewer for a wide step
    ],
)
def test_prefill_threads_per_engine_follow_the_documented_rule(
    torch_threads: int, cpus: int, threads: int
) -> None:
    """The most a wide step may take: every CPU (it takes those free when it starts, yutu.engine.cpus)."""
    from yutu.cli import prefill_threads

    assert prefill_threads(torch_threads, cpus) == threads


def test_up_steals_prefills_by_default_and_the_conductor_does_not(tmp_path: Path) -> None:
    """yutu up's instances share one host's cores, so its conductor lets a decode instance take a
    prefill off a long queue (docs/architecture.md); a conductor on its own keeps it off."""
    from yutu.cli import stack_specs, up_parser
    from yutu.config import add_policy_options

    def conductor_argv(*flags: str) -> tuple[str, ...]:
        args = up_parser().parse_args(["--redis-url", "redis://127.0.0.1:1/0", *flags])
        (spec,) = [s for s in stack_specs(args, tmp_path, "m") if s.name == "conductor"]
        return spec.argv

    assert "--prefill-stealing" in conductor_argv() and "--no-prefill-stealing" not in conductor_argv()
    assert "--no-prefill-stealing" in conductor_argv("--no-prefill-stealing")
    alone = argparse.ArgumentParser()
    add_policy_options(alone, scope="conductor")
    assert alone.parse_args([]).prefill_stealing is False


def test_up_hands_the_gateways_parsers_on(tmp_path: Path) -> None:
    """yutu up's --tool-call-parser and --reasoning-parser reach its gateway, with the same choices."""
    from yutu.cli import stack_specs, up_parser

    from services.gateway.reasoning import PARSERS as REASONING_PARSERS
    from services.gateway.tool_parsers import PARSERS as TOOL_PARSERS

    def gateway_argv(*flags: str) -> tuple[str, ...]:
        args = up_parser().parse_args(["--redis-url", "redis://127.0.0.1:1/0", *flags])
        (spec,) = [s for s in stack_specs(args, tmp_path, "m") if s.name == "gateway"]
        return spec.argv

    for flag, names in (("--reasoning-parser", REASONING_PARSERS), ("--tool-call-parser", TOOL_PARSERS)):
        assert flag not in gateway_argv()
        for name in names:
            argv = gateway_argv(flag, name)
            assert argv[argv.index(flag) + 1] == name
        with pytest.raises(SystemExit):
            gateway_argv(flag, "no-such-parser")
