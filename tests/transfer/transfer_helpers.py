"""Helpers shared by the transfer tests and their peer process (tests/transfer/transfer_peer.py)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transfer_peer.py")


def pattern(seed: int, size: int) -> np.ndarray:
    """Deterministic pseudo-random bytes, equal in every process for the same (seed, size)."""
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


def digest(data: np.ndarray | memoryview | bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class PeerProcess:
    """A TransferEngine in a child process, driven by a line protocol on stdin/stdout.

    Regions are given as ``name:size:seed`` and filled with ``pattern(seed, size)`` before the
    segment is published.
    """

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        segment: str,
        regions: list[str],
        transports: str = "shm,tcp",
        ttl_s: float = 10.0,
    ) -> None:
        cmd = [
            sys.executable,
            PEER_SCRIPT,
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
            "--segment",
            segment,
        ]
        cmd += ["--transports", transports, "--ttl", str(ttl_s)]
        for r in regions:
            cmd += ["--region", r]
        self.segment = segment
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self._readline(timeout_s=30.0)
        if not line.startswith("READY"):
            self.kill()
            raise RuntimeError(f"peer {segment} failed to start: {line!r}")
        self.port = int(line.split()[1])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _readline(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"peer {self.segment} did not answer within {timeout_s}s")
        return self.proc.stdout.readline().strip()

    def command(self, line: str, timeout_s: float = 30.0) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self._readline(timeout_s)
        if reply.startswith("ERROR"):
            raise RuntimeError(f"peer {self.segment}: {reply}")
        return reply

    def digest(self, region: str, offset: int, length: int) -> str:
        return self.command(f"digest {region} {offset} {length}").split()[1]

    async def adigest(self, region: str, offset: int, length: int) -> str:
        return await asyncio.to_thread(self.digest, region, offset, length)

    async def afill(self, region: str, seed: int) -> None:
        await asyncio.to_thread(self.command, f"fill {region} {seed}")

    def stop(self) -> None:
        """SIGSTOP, and wait until the kernel reports the process stopped (delivery is async)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state in ("T", "t"):
                return
            time.sleep(0.001)
        raise TimeoutError(f"peer {self.segment} did not stop")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def quit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("quit", timeout_s=10.0)
            except (OSError, TimeoutError, RuntimeError):
                pass
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        self.kill()
