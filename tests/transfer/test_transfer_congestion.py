"""The TCP congestion control of the data connections (``tcp_congestion``, yutu.transfer.tcp_wire).

Both ends of a data connection -- the client's pooled connection and the server's accepted one --
carry the algorithm the engine was built with (every one this process may use, and the host's
default for None), the bytes move under it, and an algorithm the process may not use is refused
when the engine is built, naming what it may use, before any socket exists.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from yutu.transfer import TransferEngine, TransferOp, TransferRequest
from yutu.transfer.tcp_wire import DEFAULT_CONGESTION, check_congestion, host_congestion, parse_congestion

KiB = 1 << 10
ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()


def congestion_of(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


@pytest.mark.parametrize("congestion", [*ALLOWED, None])
async def test_both_ends_of_a_data_connection_take_it(
    make_engine: Callable[..., TransferEngine], congestion: str | None
) -> None:
    server = make_engine("cc-server", transports=("tcp",), tcp_congestion=congestion)
    source = server.register_region("source", 256 * KiB)
    source.buffer[:] = bytes(range(256)) * KiB
    await server.start()
    client = make_engine("cc-client", transports=("tcp",), tcp_congestion=congestion)
    client.register_region("sink", 256 * KiB)
    await client.start()

    result = await client.transfer(
        [TransferRequest(TransferOp.READ, "sink", 0, "cc-server", "source", 0, 256 * KiB)]
    )
    assert result[0].ok, result[0].error
    assert bytes(client.regions["sink"].buffer) == bytes(source.buffer)

    want = congestion or host_congestion()
    (pool,) = client._tcp._pools.values()
    clients = list(pool._idle)
    assert clients and [congestion_of(s) for s in clients] == [want] * len(clients)
    assert server._server is not None
    accepted = list(server._server._conns)
    assert accepted and [congestion_of(s) for s in accepted] == [want] * len(accepted)


def test_reno_is_the_default_and_system_keeps_the_hosts() -> None:
    assert DEFAULT_CONGESTION == "reno" and "reno" in ALLOWED  # the kernel never restricts Reno
    assert parse_congestion("system") is None
    assert parse_congestion("reno") == "reno"


@pytest.mark.parametrize("bad", ["no-such-algorithm", "", "re no", "ren\x00o"])
async def test_an_algorithm_this_process_may_not_use_is_refused_up_front(
    make_engine: Callable[..., TransferEngine], bad: str
) -> None:
    with pytest.raises(ValueError, match="congestion control") as info:
        make_engine("cc-refused", transports=("tcp",), tcp_congestion=bad)
    if bad == "no-such-algorithm":
        assert " ".join(ALLOWED) in str(info.value)  # what it may use instead
        assert "--tcp-congestion system" in str(info.value)
    with pytest.raises(ValueError):
        check_congestion(bad)


@pytest.mark.parametrize("service", ["services.store_node.main", "services.worker.main"])
def test_the_services_refuse_it_as_a_usage_error(service: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", service, "--tcp-congestion", "no-such-algorithm"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "error: cannot use TCP congestion control 'no-such-algorithm' here" in done.stderr
    assert "--tcp-congestion system" in done.stderr
