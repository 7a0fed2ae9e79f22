"""The address a service advertises (``yutu.config.advertised``): explicit beats bound beats routed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yutu.config as config
from yutu.config import advertised, default_route_address, default_route_interface, interface_address

HEADER = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT"


def rows(*lines: str) -> list[str]:
    return [line.replace(" ", "\t") for line in lines]


def test_explicit_advertise_host_wins_over_any_bind_address() -> None:
    assert advertised("0.0.0.0", "store-node-1.example") == "store-node-1.example"
    assert advertised("127.0.0.1", "10.9.8.7") == "10.9.8.7"


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "localhost", "::1"])
def test_a_concrete_bind_address_is_its_own_advertised_address(host: str) -> None:
    assert advertised(host, None) == host


def test_default_route_interface_is_the_up_default_route_of_lowest_metric() -> None:
    table = rows(
        "eth1 0000A8C0 00000000 0001 0 0 0 00FFFFFF 0 0 0",  # 192.168.0.0/24: not a default route
        "wlan0 00000000 0100A8C0 0003 0 0 600 00000000 0 0 0",  # default, metric 600
        "eth0 00000000 010011AC 0003 0 0 100 00000000 0 0 0",  # default, metric 100: this one
        "tun0 00000000 00000000 0000 0 0 1 00000000 0 0 0",  # default but not up (flags 0)
    )
    assert default_route_interface(table) == "eth0"


def test_no_default_route_means_no_interface() -> None:
    assert default_route_interface(rows("eth1 0000A8C0 00000000 0001 0 0 0 00FFFFFF 0 0 0")) is None
    assert default_route_interface([]) is None


def test_a_routing_table_without_default_route_gives_no_address(tmp_path: Path) -> None:
    table = tmp_path / "route"
    table.write_text(HEADER + "\n" + "\n".join(rows("lo 0000007F 00000000 0001 0 0 0 000000FF 0 0 0")) + "\n")
    assert default_route_address(str(table)) is None
    assert default_route_address(str(tmp_path / "missing")) is None


def test_loopback_and_missing_interfaces_have_no_advertisable_address() -> None:
    assert interface_address("lo") is None  # 127.0.0.1 is never what a peer on another host should dial
    assert interface_address("yutu-nosuch0") is None


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 (`ip`) is not installed")
def test_wildcard_advertises_the_address_of_the_default_route_interface_as_iproute2_reports_it() -> None:
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show", "default"], check=True,
                                       capture_output=True, text=True).stdout)  # fmt: skip
    if not routes:
        pytest.skip("this machine has no IPv4 default route")
    device = min(routes, key=lambda r: r.get("metric", 0))["dev"]
    addrs = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show", "dev", device], check=True,
                                      capture_output=True, text=True).stdout)  # fmt: skip
    expected = addrs[0]["addr_info"][0]["local"]
    assert advertised("0.0.0.0", None) == expected
    assert advertised("::", None) == expected
    assert advertised("", None) == expected


def test_wildcard_without_route_falls_back_to_the_hostname_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "default_route_address", lambda: None)
    monkeypatch.setattr(config, "hostname_address", lambda: "10.20.30.40")
    assert advertised("0.0.0.0", None) == "10.20.30.40"


def test_wildcard_with_nothing_dialable_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "default_route_address", lambda: None)
    monkeypatch.setattr(config, "hostname_address", lambda: None)
    with pytest.raises(ValueError, match="--advertise-host"):
        advertised("0.0.0.0", None)
