"""Start, supervise and stop a group of local processes (``yutu up``, the integration tests, benches).

    start(spec) ... wait_ready() -> supervise() every tick: exits noticed, restarts run when due -> stop()

A :class:`ChildSpec` says how to start a child, so that it can be started again the same way after
a crash: same argv (same instance id), except that :data:`ADMIN_PORT` in it is a fresh free port on
every start (a restarted service registers its new endpoints in the registry; nothing dials the
old port, and the old one may have been taken meanwhile). Children with ``restart`` are restarted
after an exponential backoff (:mod:`yutu.restarts`); the exit of any other child, or a crash loop,
is fatal and :meth:`ProcessGroup.supervise` says why. Nothing is restarted once :meth:`stop` runs.

Children are stopped in reverse start order: SIGTERM, a grace period, then SIGKILL. They get
SIGTERM when the launcher dies, even by SIGKILL (Linux). Each child's output goes to the parent's
terminal (services log their own name and pid), or to ``<log_dir>/<name>.log`` when one is given.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import redis

from yutu.restarts import RestartHistory, RestartPolicy

log = logging.getLogger(__name__)

STARTUP_RETRIES = 2  # a restartable child dying while it starts is started again this often
ADMIN_PORT = "{admin_port}"  # in a ChildSpec's argv and ready_url: a fresh free port on every start
LOG_TAIL_LINES = 20


LOWEST_PICKED_PORT = 10_000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to now, for a child to bind later.

    Picked below the kernel's ephemeral range where there is room: a port from ``bind(0)`` is free
    only until it is closed, and before the child binds it, any socket bound to port 0 (another
    child's ZeroMQ endpoint, another ``free_port``) or connecting out may be given it. Nothing in
    the ephemeral range is handed out that way, so only an explicit bind can take a port from here.
    Never the same port twice in one process.
    """
    ephemeral = _ephemeral_range()
    if ephemeral is not None and ephemeral[0] - LOWEST_PICKED_PORT >= 1_000:
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(LOWEST_PICKED_PORT, ephemeral[0])
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    while True:  # no room below the range (or not Linux): the kernel's pick, never twice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class ChildSpec:
    """How to start one child (and start it again after a crash)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] | None = None  # None: the launcher's environment
    ready_url: str | None = None  # answers 200 once the child is ready
    restart: bool = False  # restarted after it exits; otherwise its exit stops the stack
    new_session: bool = False  # its own session: a terminal's Ctrl-C does not reach it

    def resolved(self) -> tuple[list[str], str | None]:
        """argv and ready URL for one start, :data:`ADMIN_PORT` replaced by a fresh free port."""
        if ADMIN_PORT not in (self.ready_url or "") and not any(ADMIN_PORT in a for a in self.argv):
            return list(self.argv), self.ready_url
        port = str(free_port())
        url = None if self.ready_url is None else self.ready_url.replace(ADMIN_PORT, port)
        return [a.replace(ADMIN_PORT, port) for a in self.argv], url


@dataclass
class Child:
    """One started child: its current process, and its restarts so far."""

    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    ready_url: str | None
    log_path: Path | None
    history: RestartHistory
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # set while the process is dead and a restart is due then
    awaiting_ready: bool = False  # restarted and not ready yet (logged once it is)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def argv(self) -> list[str]:
        return list(self.proc.args)  # type: ignore[arg-type]


def describe_exit(returncode: int) -> str:
    """``exited with code 1`` or ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class ProcessGroup:
    """Children started by this process; :meth:`stop` ends all of them."""

    log_dir: Path | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    children: list[Child] = field(default_factory=list)

    def spawn(
        self, name: str, argv: list[str], ready_url: str | None = None, env: dict[str, str] | None = None
    ) -> Child:
        """Start a child that is not restarted (its exit is fatal to :meth:`supervise`)."""
        return self.start(ChildSpec(name, tuple(argv), env, ready_url))

    def start(self, spec: ChildSpec) -> Child:
        proc, ready_url, log_path = self._launch(spec)
        child = Child(spec, proc, ready_url, log_path, RestartHistory(self.policy))
        self.children.append(child)
        return child

    def log_path(self, name: str) -> Path | None:
        """Where child ``name``'s output goes (appended to: restarts and later starts add to it)."""
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def _launch(self, spec: ChildSpec) -> tuple[subprocess.Popen[bytes], str | None, Path | None]:
        argv, ready_url = spec.resolved()
        out = None
        log_path = self.log_path(spec.name)
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = log_path.open("ab")
        try:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                env=None if spec.env is None else dict(spec.env),
                preexec_fn=die_with(os.getpid()),
                start_new_session=spec.new_session,
            )
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor
        log.debug("started %s (pid %d): %s", spec.name, proc.pid, " ".join(argv))
        return proc, ready_url, log_path

    def wait_ready(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Block until every child with a ready URL answers 200 (True) or ``should_stop()`` (False).

        A restartable child that dies while starting is started again, on a fresh :data:`ADMIN_PORT`,
        up to STARTUP_RETRIES times (the free port it was given may have been taken before it bound
        it); raise RuntimeError when one dies past that or is not restartable, TimeoutError when time
        runs out."""
        deadline = time.monotonic() + timeout_s
        pending = [c for c in self.children if c.ready_url]
        retries = dict.fromkeys((c.name for c in pending), 0)
        with httpx.Client(timeout=2.0) as http:
            while pending:
                if should_stop():
                    return False
                for child in list(pending):
                    if child.proc.poll() is not None:
                        what = f"{child.name} {describe_exit(child.proc.returncode)} while starting"
                        if child.spec.restart and retries[child.name] < STARTUP_RETRIES:
                            retries[child.name] += 1
                            log.warning(
                                "%s; starting it again (%d of %d)%s",
                                what, retries[child.name], STARTUP_RETRIES, self._tail(child),
                            )  # fmt: skip
                            self._restart(child)
                            continue
                        raise RuntimeError(f"{what}{self._tail(child)}")
                    if _answers_ready(http, child):
                        pending.remove(child)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise TimeoutError(f"not ready after {timeout_s:.0f}s: {names}")
                if pending:
                    time.sleep(0.2)
        return True

    def supervise(self) -> str | None:
        """One round of supervision: notice exits, schedule restarts, run those that are due, log
        restarted children once ready. Returns why the stack must stop (a child that is not
        restarted exited, or one is crash-looping), or None. Call it every fraction of a second."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child)
                continue
            code = child.proc.poll()
            if code is None:
                if child.awaiting_ready:
                    self._note_ready(child)
                continue
            ran = now - child.started_at
            what = f"{child.name} (pid {child.proc.pid}) {describe_exit(code)} after {ran:.1f}s"
            if not child.spec.restart:
                return f"{what}; it is not restarted, so the stack stops{self._tail(child)}"
            delay = child.history.after_exit(now, ran)
            if delay is None:
                return (
                    f"{what}, after {child.history.recent} restarts within {self.policy.window_s:.0f}s: "
                    f"it is crash-looping, so the stack stops{self._tail(child)}"
                )
            log.warning(
                "%s; restarting it in %.1fs (restart %d; %d of at most %d within %.0fs)",
                what, delay, child.history.total, child.history.recent, self.policy.max_restarts,
                self.policy.window_s,
            )  # fmt: skip
            child.restart_at = now + delay
        return None

    def _restart(self, child: Child) -> None:
        child.proc, child.ready_url, child.log_path = self._launch(child.spec)
        child.started_at = time.monotonic()
        child.restart_at = None
        child.awaiting_ready = child.ready_url is not None
        log.warning("restarted %s: pid %d", child.name, child.proc.pid)

    @staticmethod
    def _note_ready(child: Child) -> None:
        with httpx.Client(timeout=0.5) as http:
            if _answers_ready(http, child):
                child.awaiting_ready = False
                log.info("%s (pid %d) is ready again", child.name, child.proc.pid)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every child, last started first; nothing is restarted from now on."""
        for child in reversed(self.children):
            child.restart_at = None
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
        lines = child.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return f"; last lines of its log ({child.log_path}):\n" + "\n".join(lines)


def _answers_ready(http: httpx.Client, child: Child) -> bool:
    assert child.ready_url is not None
    try:
        return http.get(child.ready_url).status_code == 200
    except httpx.HTTPError:
        return False


_PR_SET_PDEATHSIG = 1


def die_with(parent_pid: int, sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the child gets ``sig`` when the launcher dies, even by SIGKILL (Linux only)."""

    def in_child() -> None:
        if sys.platform == "linux":
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig)
            if os.getppid() != parent_pid:  # the launcher died before prctl took effect
                os._exit(1)

    return in_child


def redis_reachable(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def start_redis(
    group: ProcessGroup, url: str, data_dir: Path, *, persist: bool = False, restart: bool = False
) -> Child:
    """Start a local redis-server for ``url`` (loopback only) and wait until it answers.

    It runs in its own session (a terminal's Ctrl-C reaches only the launcher, which stops Redis
    after every service) and dies with the launcher. ``persist``: an append-only file in
    ``data_dir``, fsynced every second, reloaded when it starts again; otherwise nothing is kept.
    ``restart``: restarted by :meth:`ProcessGroup.supervise` after a crash.
    """
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
    durability = ["--appendonly", "yes", "--appendfsync", "everysec"] if persist else ["--appendonly", "no"]
    argv = (binary, "--port", str(parsed.port or 6379), "--bind", host, "--save", "", *durability,
            "--dir", str(data_dir), "--logfile", str(data_dir / "redis.log"))  # fmt: skip
    child = group.start(ChildSpec("redis", argv, restart=restart, new_session=True))
    deadline = time.monotonic() + 15
    while not redis_reachable(url):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"redis-server did not start for {url} (exit code {child.proc.poll()}); "
                f"see {data_dir / 'redis.log'}"
            )
        time.sleep(0.1)
    return child


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
