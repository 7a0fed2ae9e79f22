"""yutu.sched is pure: importable without torch, no I/O, no clock, no asyncio, no services."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import yutu.sched

PACKAGE = Path(yutu.sched.__file__).parent
ALLOWED = {
    "__future__",
    "abc",
    "collections",
    "dataclasses",
    "enum",
    "itertools",
    "math",
    "numpy",
    "typing",
    "yutu.errors",
    "yutu.sched",
}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_imports_only_pure_modules() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        bad = {n for n in imported(path) if not any(n == a or n.startswith(a + ".") for a in ALLOWED)}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_importable_without_torch_and_loads_no_runtime() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import yutu.sched\n"
        "loaded = sorted(m for m in ('torch', 'asyncio', 'zmq', 'redis', 'yutu.engine', 'services') if sys.modules.get(m) is not None)\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stderr
