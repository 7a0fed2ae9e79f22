"""The contract every policy keeps (yutu.evict is pure; the same calls give the same answers)."""

from __future__ import annotations

import ast
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yutu.evict
from yutu.evict import POLICIES, EvictionPolicy, make_policy


def test_exports_and_names() -> None:
    assert POLICIES == ("lru", "lfu", "adaptive")
    assert set(yutu.evict.__all__) == {"POLICIES", "EvictionPolicy", "make_policy"}
    for name in POLICIES:
        policy = make_policy(name, 8)
        assert isinstance(policy, EvictionPolicy) and policy.name == name


def test_importable_without_the_runtime() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import yutu.evict\n"
        "print(sorted(m for m in ('torch', 'asyncio', 'zmq', 'redis', 'yutu.store', 'services')"
        " if sys.modules.get(m) is not None))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_imports_only_pure_modules() -> None:
    allowed = {"__future__", "bisect", "collections", "typing", "yutu.evict"}
    files = sorted(Path(yutu.evict.__file__).parent.glob("*.py"))
    assert len(files) == 5
    for path in files:
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        bad = {n for n in names if n.split(".")[0] not in allowed and not n.startswith("yutu.evict")}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def replay(name: str, capacity: int, keys: list[str]) -> tuple[int, list[str]]:
    """A cache of ``capacity`` unit-size keys; answers hits and the evictions in order."""
    policy = make_policy(name, capacity)
    hits = 0
    evicted: list[str] = []
    for key in keys:
        if key in policy:
            hits += 1
            policy.access(key)
            continue
        for victim in policy.victims(policy.used + 1 - capacity):
            policy.remove(victim)
            evicted.append(victim)
        policy.insert(key)
        assert policy.used <= capacity and len(policy) == policy.used
    return hits, evicted


@pytest.mark.parametrize("name", POLICIES)
def test_deterministic_and_bounded(name: str) -> None:
    rng = random.Random(7)
    keys = [f"k{min(int(rng.expovariate(0.05)), 200)}" for _ in range(3000)]
    first = replay(name, 32, keys)
    assert first == replay(name, 32, keys)
    hits, evicted = first
    assert len(set(keys)) - 32 <= len(evicted) == 3000 - hits - 32
