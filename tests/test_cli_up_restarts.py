"""The restart policy of `yutu up` (backoff, healthy reset, crash loop) and ProcessGroup supervision
of real (tiny) child processes."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from yutu.launcher import ADMIN_PORT, LOWEST_PICKED_PORT, ChildSpec, ProcessGroup, describe_exit, free_port
from yutu.restarts import RestartHistory, RestartPolicy


def test_backoff_doubles_to_its_cap_and_resets_after_a_healthy_run() -> None:
    history = RestartHistory(RestartPolicy(max_restarts=100, window_s=1000.0))
    delays = [history.after_exit(now=float(i), ran_for_s=1.0) for i in range(7)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert history.after_exit(now=100.0, ran_for_s=30.0) == 0.5  # ran healthy: start over
    assert history.after_exit(now=101.0, ran_for_s=0.1) == 1.0
    assert history.total == 9


def test_more_restarts_than_allowed_within_the_window_is_a_crash_loop() -> None:
    history = RestartHistory(RestartPolicy(max_restarts=3, window_s=60.0))
    assert [history.after_exit(t, 0.1) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 2.0]
    assert history.after_exit(3.0, 0.1) is None  # a fourth restart within 60 s: give up
    assert history.recent == 3
    later = RestartHistory(RestartPolicy(max_restarts=3, window_s=60.0))
    for t in (0.0, 1.0, 2.0):
        later.after_exit(t, 0.1)
    assert later.after_exit(61.5, 0.1) == 4.0  # the first two left the window
    assert later.recent == 2


def test_zero_restarts_means_any_crash_is_fatal_and_bad_policies_are_refused() -> None:
    assert RestartHistory(RestartPolicy(max_restarts=0)).after_exit(0.0, 100.0) is None
    with pytest.raises(ValueError, match="--max-restarts must be 0 or more"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="--restart-window must be positive"):
        RestartPolicy(window_s=0)


def test_exit_descriptions_name_the_code_or_the_signal() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


def supervise_until(group: ProcessGroup, done: object, timeout_s: float = 30.0) -> str | None:
    """Run supervision rounds until ``done()`` or a fatal reason; return the reason (or None)."""
    assert callable(done)
    deadline = time.monotonic() + timeout_s
    while not done():
        fatal = group.supervise()
        if fatal is not None:
            return fatal
        assert time.monotonic() < deadline, "supervision did not get there in time"
        time.sleep(0.05)
    return None


def test_a_crashing_child_is_restarted_with_its_arguments_until_it_crash_loops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="yutu.launcher")
    marks = tmp_path / "starts"
    code = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); print('bye'); sys.exit(3)"
    policy = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, max_restarts=2, window_s=60.0)
    group = ProcessGroup(tmp_path / "logs", policy)
    try:
        group.start(ChildSpec("flaky", (sys.executable, "-c", code, str(marks), ADMIN_PORT), restart=True))
        pids = {group.children[0].proc.pid}
        fatal = supervise_until(group, lambda: False)
        pids.add(group.children[0].proc.pid)
    finally:
        group.stop()
    ports = marks.read_text().split()
    assert len(ports) == 3  # the first start and two restarts, each on a fresh free port
    assert len(set(ports)) == 3 and all(p.isdigit() for p in ports)
    assert len(pids) == 2  # a new process each time (first and last seen here)
    assert fatal is not None
    assert fatal.startswith("flaky (pid ")
    assert "exited with code 3" in fatal and "after 2 restarts within 60s: it is crash-looping" in fatal
    assert "last lines of its log" in fatal and fatal.endswith("bye")  # the tail of logs/flaky.log
    restarts = [r.getMessage() for r in caplog.records if "restarting it in" in r.getMessage()]
    assert len(restarts) == 2
    assert "exited with code 3" in restarts[0] and "restarting it in 0.1s (restart 1;" in restarts[0]
    assert "restarting it in 0.1s (restart 2;" in restarts[1]  # 0.05 s is printed as 0.1


def test_a_child_that_is_not_restarted_stops_the_stack(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    try:
        group.start(ChildSpec("front", (sys.executable, "-c", "import sys; sys.exit(7)")))
        fatal = supervise_until(group, lambda: False)
    finally:
        group.stop()
    assert fatal is not None and fatal.startswith("front (pid ")
    assert "exited with code 7" in fatal and "it is not restarted, so the stack stops" in fatal


def test_nothing_is_restarted_once_stop_has_begun(tmp_path: Path) -> None:
    group = ProcessGroup(None, RestartPolicy(initial_backoff_s=0.05))
    child = group.start(
        ChildSpec("sleeper", (sys.executable, "-c", "import time; time.sleep(60)"), restart=True)
    )
    first = child.proc
    first.kill()
    first.wait()
    assert supervise_until(group, lambda: child.restart_at is not None) is None  # a restart is due
    group.stop()
    time.sleep(0.2)  # past the due time: a restart would have happened in supervise() below
    assert group.supervise() is None
    assert group.children == [] and child.proc is first and child.restart_at is None


READY_ON_SECOND_START = """
import http.server, os, sys
marks, port = sys.argv[1], int(sys.argv[2])
first = not os.path.exists(marks)
open(marks, "a").write(sys.argv[2] + "\\n")
if first:
    print("cannot bind: address already in use")
    sys.exit(4)
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


def test_a_child_that_dies_while_starting_is_started_again_on_a_fresh_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="yutu.launcher")
    marks = tmp_path / "starts"
    group = ProcessGroup(tmp_path / "logs")
    try:
        spec = ChildSpec(
            "node", (sys.executable, "-c", READY_ON_SECOND_START, str(marks), ADMIN_PORT),
            ready_url=f"http://127.0.0.1:{ADMIN_PORT}/ready", restart=True,
        )  # fmt: skip
        group.start(spec)
        assert group.wait_ready(60) is True
    finally:
        group.stop()
    ports = marks.read_text().split()
    assert len(ports) == 2 and ports[0] != ports[1]  # started again on a fresh port
    (warning,) = [r.getMessage() for r in caplog.records if "starting it again" in r.getMessage()]
    assert "node exited with code 4 while starting; starting it again (1 of 2)" in warning
    assert "address already in use" in warning  # the tail of its log says why


def test_a_child_that_keeps_dying_while_starting_stops_the_start(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    code = "import sys; print('bad option'); sys.exit(2)"
    try:
        spec = ChildSpec("node", (sys.executable, "-c", code, ADMIN_PORT),
                         ready_url=f"http://127.0.0.1:{ADMIN_PORT}/ready", restart=True)  # fmt: skip
        group.start(spec)
        with pytest.raises(RuntimeError, match="node exited with code 2 while starting") as err:
            group.wait_ready(60)
    finally:
        group.stop()
    assert "bad option" in str(err.value)


def test_free_ports_are_never_handed_out_twice_nor_from_the_kernels_ephemeral_range() -> None:
    """A port from free_port stays free until a child binds it: a ZeroMQ endpoint bound to port 0
    (or another free_port) cannot be given it meanwhile, as a CI run once saw (the gateway's port
    taken by the store master's admin app)."""
    low, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PICKED_PORT <= p < low for p in ports)
    held = [socket.create_server(("127.0.0.1", 0)) for _ in range(50)]  # the kernel's own picks
    try:
        assert not {s.getsockname()[1] for s in held} & set(ports)
        for port in ports[:20]:  # and each one can be bound
            socket.create_server(("127.0.0.1", port)).close()
    finally:
        for s in held:
            s.close()
