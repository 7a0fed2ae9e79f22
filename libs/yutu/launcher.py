"""Start, watch and stop a group of local processes (``yutu up`` and the integration tests).

Children are started in order and stopped in reverse order: SIGTERM, a grace period, then SIGKILL.
Each child's output goes to the parent's terminal prefixed with nothing (services log their own
name and pid), or to a log file when one is given.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import redis

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    ready_url: str | None = None
    log_path: Path | None = None


@dataclass
class ProcessGroup:
    """Children started by this process; :meth:`stop` ends all of them."""

    log_dir: Path | None = None
    children: list[Child] = field(default_factory=list)

    def spawn(
        self, name: str, argv: list[str], ready_url: str | None = None, env: dict[str, str] | None = None
    ) -> Child:
        out = None
        log_path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{name}.log"
            out = log_path.open("ab")
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT if out else None, env=env, preexec_fn=_die_with_parent
        )
        if out is not None:
            out.close()  # the child holds its own descriptor
        child = Child(name, argv, proc, ready_url, log_path)
        self.children.append(child)
        log.debug("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
        return child

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every child with a ready URL answers 200; raise if one dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        pending = [c for c in self.children if c.ready_url]
        with httpx.Client(timeout=2.0) as http:
            while pending:
                for child in list(pending):
                    if child.proc.poll() is not None:
                        raise RuntimeError(
                            f"{child.name} exited with code {child.proc.returncode} while starting{self._tail(child)}"
                        )
                    assert child.ready_url is not None
                    try:
                        if http.get(child.ready_url).status_code == 200:
                            pending.remove(child)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise TimeoutError(f"not ready after {timeout_s:.0f}s: {names}")
                if pending:
                    time.sleep(0.2)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self, grace_s: float = 15.0) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while child.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.proc.poll() is None:
                log.warning("%s did not stop in %.0fs; killing it", child.name, grace_s)
                child.proc.kill()
                child.proc.wait()
        self.children.clear()

    @staticmethod
    def _tail(child: Child) -> str:
        if child.log_path is None or not child.log_path.exists():
            return ""
        lines = child.log_path.read_text(errors="replace").splitlines()[-20:]
        return "; last lines of its log:\n" + "\n".join(lines)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, even by SIGKILL (Linux only)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def redis_reachable(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def start_redis(group: ProcessGroup, url: str, data_dir: Path) -> None:
    """Start a local redis-server for ``url`` (loopback only) and wait until it answers."""
    parsed = urlparse(url)
    host = parsed.hostname or "127.0.0.1"
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise RuntimeError(f"Redis at {url} is not reachable and is not local: start it, or pass --redis-url")
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            f"Redis at {url} is not reachable and redis-server is not installed.\n"
            "  Install it:  sudo apt-get install -y redis-server   (or: make run, which installs it)\n"
            "  or point Yutu at a running Redis with --redis-url / YUTU_REDIS_URL."
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [binary, "--port", str(parsed.port or 6379), "--bind", host, "--save", "", "--appendonly", "no",
            "--dir", str(data_dir), "--logfile", str(data_dir / "redis.log")]  # fmt: skip
    child = group.spawn("redis", argv)
    deadline = time.monotonic() + 15
    while not redis_reachable(url):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not start for {url} (exit code {child.proc.poll()})")
        time.sleep(0.1)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
