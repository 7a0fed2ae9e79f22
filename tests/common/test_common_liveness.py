"""Heartbeat timing (yutu.liveness, on an injected clock) and loops that survive (yutu.supervise)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from yutu.liveness import Liveness, Silent
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.service import HttpServer, Service, admin_app, serve
from yutu.supervise import Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_turns_silent_once_past_its_window_and_comes_back_when_heard() -> None:
    clock = Clock()
    live = Liveness[str](3.0, clock)
    live.watch("a")
    live.watch("b")
    assert not live.has_answered("a")  # watched, never heard
    clock.now += 1.0
    assert live.heard("a") is False and live.has_answered("a")
    assert live.expired() == []
    clock.now += 1.0
    live.heard("a")
    clock.now += 1.5  # b: 3.5 s since watched; a: 1.5 s since heard
    assert live.expired() == [Silent("b", 3.5)]
    assert live.is_silent("b") and not live.is_silent("a")
    clock.now += 1.0
    assert live.expired() == []  # reported once, not on every check
    clock.now += 1.0  # a: 3.5 s silent now
    assert live.expired() == [Silent("a", 3.5)]
    assert not live.has_answered("a")
    assert live.heard("b") is True  # back
    assert not live.is_silent("b") and live.has_answered("b")
    assert live.heard("b") is False
    live.forget("a")
    assert "a" not in live and len(live) == 1
    clock.now += 0.5
    assert live.expired() == []


def test_each_peer_may_declare_its_own_window() -> None:
    clock = Clock()
    live = Liveness[bytes](3.0, clock)
    live.heard(b"fast", timeout_s=1.0)
    live.heard(b"default")
    clock.now += 0.9
    assert live.expired() == []
    clock.now += 0.9
    assert live.expired() == [Silent(b"fast", pytest.approx(1.8))]
    clock.now += 1.0
    assert live.expired() == []  # default: 2.8 s of its 3.0
    clock.now += 0.9
    assert [s.key for s in live.expired()] == [b"default"]


def test_a_late_check_means_we_were_stalled_not_the_peers() -> None:
    clock = Clock()
    live = Liveness[str](3.0, clock)
    live.heard("a")
    assert live.expired() == []
    clock.now += 20.0  # this process was frozen (SIGSTOP) for 20 s: nobody could be heard
    assert live.expired() == []  # every window restarts instead
    clock.now += 1.0
    live.heard("a")  # its messages, queued meanwhile, are read now
    clock.now += 1.0
    assert live.expired() == []
    clock.now += 3.0  # silent for a whole window with us awake: now it is the peer
    assert live.expired() == [Silent("a", 4.0)]


def test_windows_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Liveness[str](0.0)


async def test_every_survives_failing_steps_and_a_dead_loop_makes_the_service_not_ready(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Idle(Service):
        kind = "idle"

        async def startup(self) -> None:
            pass

        async def shutdown(self) -> None:
            pass

    calls = 0
    third = asyncio.Event()

    async def step() -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError(f"bad record {calls}")
        third.set()

    service = Idle()
    http = HttpServer(admin_app(service), "127.0.0.1", 0)
    await http.start()
    try:
        caplog.set_level(logging.ERROR, logger="yutu.supervise")
        task = service.loops.every("poll", 0.01, step)
        await asyncio.wait_for(third.wait(), 10)
        assert not task.done() and service.loops.problems == {}
        assert caplog.text.count("a step of poll failed (the loop goes on)") == 2
        assert "bad record 1" in caplog.text and "bad record 2" in caplog.text
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}") as client:
            assert (await client.get("/ready")).status_code == 200

            async def dies() -> None:
                raise KeyError("what no step expected")

            await asyncio.gather(service.loops.spawn("watcher", dies()), return_exceptions=True)
            resp = await client.get("/ready")
            assert resp.status_code == 503
            assert resp.json()["problems"] == ["watcher died: KeyError: 'what no step expected'"]
    finally:
        await service.loops.close()
        await http.stop()


async def test_registration_runs_under_a_supervisor_and_survives_a_bad_heartbeat(
    redis_url: str, registry_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    loops = Supervisor("test")
    registry = Registry.from_url(redis_url, registry_prefix)
    record = ServiceRecord("worker", "w1", {"generate": "tcp://127.0.0.1:1"}, {"load": 0})
    registration = Registration(registry, record, ttl_s=0.3, supervisor=loops)
    await registration.start()
    try:
        assert loops.tasks == {"registration-worker": registration.task}
        caplog.set_level(logging.ERROR, logger="yutu.registry")
        registration.update_meta(load=object())  # not JSON: that heartbeat fails, the next may not
        for _ in range(100):
            if "failed unexpectedly" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert "registry heartbeat for w1 failed unexpectedly" in caplog.text
        registration.update_meta(load=7)
        for _ in range(100):
            fetched = await registry.get("worker", "w1")
            if fetched is not None and fetched.meta == {"load": 7}:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the heartbeat did not recover")
        assert registration.task is not None and not registration.task.done()
        assert loops.problems == {}
        await registration.close()
        assert await registry.list("worker") == []  # deregistered
    finally:
        await registration.close()
        await registry.close()


async def test_serve_stops_periodic_loops_before_shutdown_closes_what_they_use() -> None:
    """A periodic step never runs once shutdown began (a worker's load report ticked once on a
    socket shutdown had closed, and logged a traceback on Ctrl-C)."""
    ran_after_close: list[float] = []

    class Reporting(Service):
        kind = "reporting"
        closed = False

        async def startup(self) -> None:
            self.loops.every("report", 0.001, self.report)

        def report(self) -> None:
            if self.closed:
                ran_after_close.append(time.monotonic())
            else:
                self.stopping.set()  # ticked once: stop

        async def shutdown(self) -> None:
            self.closed = True  # "the socket is closed"
            await asyncio.sleep(0.05)  # shutdown takes a while; a live loop would tick meanwhile

    service = Reporting()
    await asyncio.wait_for(serve(service, HttpServer(admin_app(service), "127.0.0.1", 0)), 30)
    assert service.closed and ran_after_close == []
