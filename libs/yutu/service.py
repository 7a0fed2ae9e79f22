"""The common service lifecycle and the admin REST app.

    startup -> serve until SIGINT/SIGTERM -> stop intake -> drain (with a timeout) -> shutdown

A :class:`Service` owns its sockets and tasks; :func:`run_main` drives it on a uvloop event loop
(a loopback round trip costs about 15 us there against 60 us on the stock loop) and serves its admin app (``/health``, ``/ready``, ``/metrics``, ``/info`` plus the service's own routes)
with uvicorn on a socket we bind ourselves, so port 0 works and the bound port is known.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, is_dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import redis
import uvicorn
import uvloop
from fastapi import APIRouter, FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest

from yutu.config import advertised
from yutu.errors import BindError, StartupError
from yutu.gcpauses import PAUSE_BUCKETS, freeze_startup_heap, process_pauses
from yutu.logs import setup_logging
from yutu.supervise import Supervisor

log = logging.getLogger(__name__)

try:
    VERSION = version("yutu")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown (not installed)"


class Service(ABC):
    """One Yutu process. Subclasses set ``kind`` and implement the hooks."""

    kind: str = "service"

    def __init__(self) -> None:
        self.metrics = CollectorRegistry()
        self.stopping = asyncio.Event()
        self.http_url = ""  # where peers reach this service's HTTP app; set by serve() before startup
        self.loops = Supervisor(self.kind)  # every background task; a dead one makes us not ready
        self.process_started_at = time.time()

    @abstractmethod
    async def startup(self) -> None:
        """Bind sockets, connect to peers, register; raise to abort the start."""

    async def drain(self) -> None:  # noqa: B027 - optional hook
        """Stop taking new work and let in-flight work finish (bounded by the caller's timeout)."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Release everything ``startup`` took. Must be safe after a partial startup."""

    def is_ready(self) -> bool:
        """Whether the service's dependencies are reachable and it can take work."""
        return True

    def problems(self) -> list[str]:
        """Why the service cannot serve even though it runs (a dead loop, a broken engine).

        Subclasses add their own reasons to the supervisor's; any problem makes ``/ready`` 503.
        """
        return sorted(self.loops.problems.values())

    def readiness(self) -> tuple[bool, list[str]]:
        """(ready, reasons when not): what ``/ready`` answers."""
        reasons = self.problems()
        if self.stopping.is_set():
            reasons.append("stopping")
        if not self.is_ready():
            reasons.append("not ready yet (dependencies not reachable or still starting)")
        return not reasons, reasons

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def admin_router(self) -> APIRouter | None:
        """Routes of this service's own resources, mounted on the admin app."""
        return None


def admin_app(service: Service) -> FastAPI:
    app = FastAPI(title=f"yutu {service.kind} admin", version=VERSION, docs_url="/docs", redoc_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        ok, reasons = service.readiness()
        body: dict[str, Any] = {"ready": ok}
        if reasons:
            body["problems"] = reasons
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        """The service's own facts, plus what every service says: version, uptime, configuration
        (secrets redacted) and the problems ``/ready`` would name."""
        settings = getattr(service, "settings", None)
        config = (
            redacted(asdict(settings)) if is_dataclass(settings) and not isinstance(settings, type) else {}
        )
        return {
            "version": VERSION,
            "uptime_s": round(time.time() - service.process_started_at, 3),
            "gc_frozen_objects": gc.get_freeze_count(),  # start-up objects no collection walks (yutu.gcpauses)
            **service.info(),
            "config": config,
            "problems": service.problems(),
        }

    router = service.admin_router()
    if router is not None:
        app.include_router(router)
    return app


SECRET_WORDS = frozenset({"token", "key", "keys", "password", "secret", "secrets"})


def is_secret_name(name: str) -> bool:
    """A field named like a secret: one of SECRET_WORDS as a word of its snake_case name
    (``admin_token``, ``api_keys``), not as part of a word (``max_num_batched_tokens``)."""
    return any(part in SECRET_WORDS for part in name.lower().split("_"))


def redacted(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the value of every field named like a secret (token, key, password, secret)
    replaced by ``"<redacted>"`` when set, recursively; everything else as it is (JSON-safe)."""
    out: dict[str, Any] = {}
    for name, value in config.items():
        if isinstance(value, dict):
            out[name] = redacted(value)
        elif is_secret_name(name) and value not in (
            None,
            "",
            [],
            (),
            frozenset(),
        ):
            out[name] = "<redacted>"
        elif isinstance(value, str | int | float | bool) or value is None:
            out[name] = value
        elif isinstance(value, list | tuple | set | frozenset):
            out[name] = [v if isinstance(v, str | int | float | bool) or v is None else str(v) for v in value]
        else:
            out[name] = str(value)
    return out


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the service lifecycle owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


# How long an idle HTTP connection stays open. uvicorn's default (5 s) equals the idle expiry of
# httpx, hence of the OpenAI Python SDK: a client reusing a connection just as the server closes
# it gets a failed request (httpx.ReadError), reproduced reusing at 4.998 s. Longer than the usual
# client expiries (httpx 5 s, aiohttp 15 s) and a load balancer's usual 60 s, as nginx's 75 s.
KEEP_ALIVE_S = 75


class HttpServer:
    """Serves an ASGI app on ``host:port`` (0: any free port) inside the running loop."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        advertise_host: str | None = None,
        log_level: str = "warning",
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise BindError(f"cannot bind {host}:{port}: {exc.strerror}; pick another port") from exc
        self.sock.listen(2048)
        self.sock.setblocking(False)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://{advertised(host, advertise_host)}:{self.port}"  # what peers dial
        config = uvicorn.Config(
            app,
            log_level=log_level,
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=KEEP_ALIVE_S,
            log_config=None,  # uvicorn's loggers go through ours (text or JSON, see yutu.logs)
        )
        self._server = _Uvicorn(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]), name="http-server")
        while not self._server.started:
            if self._task.done():
                await self._task  # raises the start-up error
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close()


S = TypeVar("S")


def run_main(
    args: argparse.Namespace,
    build: Callable[[argparse.Namespace], S],
    main: Callable[[S], Coroutine[Any, Any, int]],
) -> int:
    """A service's ``run``: settings from the parsed flags (a ValueError is a usage error), logging,
    then ``main(settings)`` on a uvloop event loop; returns the exit code."""
    try:
        settings = build(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    setup_logging(args.log_level, getattr(args, "log_format", "text"))
    try:
        return uvloop.run(main(settings))
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return 1


async def serve(service: Service, http: HttpServer, drain_timeout_s: float = 30.0) -> None:
    """Run ``service`` with ``http`` until SIGINT/SIGTERM, then drain and shut down."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.stopping.set)
    service.http_url = http.url
    pauses = process_pauses()
    histogram = Histogram(
        "yutu_gc_pause_seconds",
        "How long this process stopped for each garbage collection (the start-up heap is frozen out of them)",
        ["generation"],
        registry=service.metrics,
        buckets=PAUSE_BUCKETS,
    )

    def listener(generation: int, seconds: float) -> None:
        histogram.labels(str(generation)).observe(seconds)

    try:
        try:
            await service.startup()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StartupError(
                f"Redis does not answer ({exc}): start it, or point --redis-url at it"
            ) from exc
        frozen = freeze_startup_heap()
        log.info(
            "%s: %d start-up objects frozen out of garbage collection (yutu.gcpauses)", service.kind, frozen
        )
        pauses.listeners.append(listener)  # pauses from now on: start-up's, and the freeze's own, are not
        await http.start()
        log.info("%s ready (http on %s:%d)", service.kind, http.host, http.port)
        await service.stopping.wait()
        log.info("%s stopping: draining for up to %.0fs", service.kind, drain_timeout_s)
        try:
            await asyncio.wait_for(service.drain(), drain_timeout_s)
        except TimeoutError:
            log.warning("%s drain timed out; cancelling what is left", service.kind)
    finally:
        await http.stop()
        await service.loops.stop_periodic()  # no heartbeat or poll ticks on what shutdown closes
        await service.shutdown()
        await service.loops.close()
        # The process may go on (tests run services in it): its heap is collectable again, and
        # untimed once no service of it is left.
        if listener in pauses.listeners:
            pauses.listeners.remove(listener)
        if not pauses.listeners:
            pauses.uninstall()
        gc.unfreeze()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
