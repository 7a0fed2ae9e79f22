"""Command-line options that can also be set from the environment.

Every option can be set from the environment when its flag is not given: flag beats environment
beats default. Options every service shares (``--redis-url``, ``--model``, ...) and the options of
``yutu up`` read ``YUTU_<OPTION>``; a service's own options read ``YUTU_<SERVICE>_<OPTION>``
(``--port`` of the gateway is ``YUTU_GATEWAY_PORT``), so one variable never sets two services' ports
at once. ``--help`` shows the variable and the default next to each option.
Services turn the parsed namespace into one frozen settings dataclass in their ``main`` and pass that
down; nothing below ``main`` reads the environment.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


DEVICES = ("auto", "cpu", "cuda")  # --device of the engines (auto: cuda where torch sees a GPU)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype of the engines (yutu.engine.loader.auto_dtype)
KERNEL_CHOICES = ("auto", "native", "torch")  # --kernels of the engines (yutu.engine.native)


def env_name(flag: str, scope: str = "") -> str:
    """``("--some-name", "store-master")`` -> ``YUTU_STORE_MASTER_SOME_NAME``."""
    parts = [scope, flag.lstrip("-")] if scope else [flag.lstrip("-")]
    return "YUTU_" + "_".join(parts).replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    default: Any,
    help: str,
    type: Callable[[str], Any] = str,
    scope: str = "",
    **kwargs: Any,
) -> None:
    """Add ``flag`` whose default comes from ``env_name(flag, scope)`` when that variable is set."""
    env = env_name(flag, scope)
    raw = os.environ.get(env)
    if raw is not None:
        try:
            default = parse_bool(raw) if type is bool else type(raw)
        except ValueError as exc:
            raise SystemExit(f"error: environment variable {env}={raw!r} is invalid: {exc}") from None
    shown = "none" if default is None else default
    if type is bool:
        parser.add_argument(
            flag,
            default=default,
            action=argparse.BooleanOptionalAction,
            help=f"{help} [env {env}; default {shown}]",
        )
    else:
        parser.add_argument(
            flag, default=default, type=type, help=f"{help} [env {env}; default {shown}]", **kwargs
        )


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Options every service takes: where Redis is, where to bind, logging."""
    group = parser.add_argument_group("common")
    option(group, "--redis-url", default=DEFAULT_REDIS_URL, help="Redis registry URL")
    option(
        group, "--registry-prefix", default="yutu", help="prefix of every Redis key this deployment writes"
    )
    option(group, "--host", default="127.0.0.1", help="address to bind the service's sockets on")
    option(
        group,
        "--advertise-host",
        default=None,
        help="address other services use to reach this one (default: --host; for 0.0.0.0 the address on the default route's interface)",
    )
    option(
        group, "--instance-id", default=None, help="unique id of this instance (default: kind-hostname-pid)"
    )
    option(
        group,
        "--registry-ttl",
        type=float,
        default=10.0,
        help="seconds this instance's registry record outlives its last heartbeat",
    )
    option(group, "--log-level", default="info", help="debug, info, warning or error")
    option(
        group,
        "--log-format",
        default="text",
        choices=("text", "json"),
        help="text, or json: one object per line with ts, level, logger, pid, message and request_id",
    )


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model and --served-model-name, shared by every service that loads the model or its tokenizer."""
    group = parser.add_argument_group("model")
    option(
        group,
        "--model",
        default=None,
        help="Hugging Face checkpoint dir (or hub id); none: the built-in demo model",
    )
    option(
        group,
        "--served-model-name",
        default=None,
        help="model name clients use (default: derived from --model)",
    )


def default_instance_id(kind: str) -> str:
    return f"{kind}-{socket.gethostname()}-{os.getpid()}"


WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # bind addresses that mean "every interface"
_RTF_UP = 0x1  # route flag: usable
_SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address


def advertised(host: str, advertise_host: str | None) -> str:
    """The address peers should dial for a socket bound on ``host``.

    An explicit ``advertise_host`` wins. A concrete ``host`` (loopback or not) is its own answer. A
    wildcard (``0.0.0.0``, ``::``) is reachable on every interface, so peers get the one they can
    most likely dial from another host: this host's address on the interface of the default route,
    else the hostname's address when that is not loopback. Raises ``ValueError`` naming the fix
    when there is neither (never 127.0.0.1: peers on other hosts would dial themselves)."""
    if advertise_host:
        return advertise_host
    if host not in WILDCARD_HOSTS:
        return host
    address = default_route_address() or hostname_address()
    if address is None:
        raise ValueError(
            f"cannot tell which address peers should dial for a service bound on {host!r}: there is no"
            " default route and the hostname resolves to loopback; pass --advertise-host (YUTU_ADVERTISE_HOST)"
        )
    return address


def default_route_address(route_table: str = "/proc/net/route") -> str | None:
    """This host's IPv4 address on the interface of its default route (the one of lowest metric),
    or None without a default route or when that interface has no IPv4 address.

    ``route_table`` is Linux's routing table as text (``/proc/net/route`` shows the calling process's
    network namespace)."""
    try:
        rows = Path(route_table).read_text().splitlines()[1:]
    except OSError:
        return None
    interface = default_route_interface(rows)
    return None if interface is None else interface_address(interface)


def default_route_interface(rows: list[str]) -> str | None:
    """The interface of the default route in ``/proc/net/route`` rows (header dropped), lowest metric
    first; None when no row is a default route (destination and mask 0, route up)."""
    defaults: list[tuple[int, str]] = []
    for row in rows:
        fields = row.split()
        if len(fields) < 8:
            continue
        interface, destination, flags, metric, mask = fields[0], fields[1], fields[3], fields[6], fields[7]
        if int(destination, 16) == 0 and int(mask, 16) == 0 and int(flags, 16) & _RTF_UP:
            defaults.append((int(metric), interface))
    return min(defaults)[1] if defaults else None


def interface_address(interface: str) -> str | None:
    """The IPv4 address of ``interface`` (``SIOCGIFADDR``), or None when it has none."""
    request = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:  # EADDRNOTAVAIL: no IPv4 address; ENODEV: gone
            return None
    address = socket.inet_ntoa(reply[20:24])  # struct ifreq: 16 bytes of name, then a sockaddr_in
    return None if _loopback_or_unset(address) else address


def hostname_address() -> str | None:
    """The IPv4 address this host's name resolves to, or None when it does not resolve or is loopback."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if _loopback_or_unset(address) else address


def _loopback_or_unset(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or ip.is_unspecified


@dataclass(frozen=True)
class ServiceSettings:
    """The common options, resolved; every service's settings dataclass extends this one."""

    host: str  # bind address of the service's sockets
    advertise_host: str  # the address peers dial (resolved: never empty)
    redis_url: str
    registry_prefix: str
    registry_ttl_s: float  # the registry record's TTL; heartbeats come every third of it
    instance_id: str  # unique in the deployment (resolved: kind-hostname-pid by default)
    log_level: str

    @staticmethod
    def common(args: argparse.Namespace, kind: str) -> dict[str, Any]:
        """The common fields from parsed flags, as keywords for a subclass's constructor."""
        if args.registry_ttl <= 0:
            raise ValueError(f"--registry-ttl must be positive, got {args.registry_ttl}")
        return {
            "host": args.host,
            "advertise_host": advertised(args.host, args.advertise_host),
            "redis_url": args.redis_url,
            "registry_prefix": args.registry_prefix,
            "registry_ttl_s": args.registry_ttl,
            "instance_id": args.instance_id or default_instance_id(kind),
            "log_level": args.log_level,
        }


DEFAULT_POLICY = "kvcentric"
# Uncached prompt tokens at or below which the decode instance prefills a request itself instead of
# handing it over (0: always hand over). Measured by loadtests/bench_disagg.py's threshold scenario:
# the largest remainder whose local prefill saves the request more than it stalls the streams
# decoding there (docs/architecture.md has the numbers).
DEFAULT_DISAGG_THRESHOLD = 32


def add_policy_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, scope: str, prefill_stealing: bool = False
) -> None:
    """The placement options ``yutu conductor`` takes and ``yutu up`` passes on (same names);
    ``prefill_stealing``: that option's default (``yutu up``'s differs: docs/architecture.md)."""
    from yutu.sched import POLICIES  # local: yutu.sched is only needed by the commands that place

    opt = partial(option, scope=scope)
    opt(parser, "--policy", default=DEFAULT_POLICY, help=f"placement policy: {', '.join(sorted(POLICIES))}")
    opt(
        parser,
        "--disagg-threshold",
        type=int,
        default=DEFAULT_DISAGG_THRESHOLD,
        help="uncached prompt tokens at or below which the decode instance prefills itself (0: never)",
    )
    opt(
        parser,
        "--prefill-stealing",
        type=bool,
        default=prefill_stealing,
        help="a decode instance takes a prefill off a prefill instance's queue when it would finish it "
        "sooner and that saves more time than it adds to the sequences decoding there",
    )
    opt(
        parser,
        "--balancing-threshold",
        type=float,
        default=1.0,
        help="fetch a longer prefix from the store only when it is this many times the local one",
    )
    opt(
        parser,
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="reject (429) requests predicted to miss this TTFT",
    )
    opt(
        parser,
        "--slo-tbt-ms",
        type=float,
        default=None,
        help="reject (429) requests predicted to miss this TBT",
    )
