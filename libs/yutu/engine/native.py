"""Native CPU kernels: C++ built once per machine by torch's extension builder, loaded by engines.

- ``dense_decode_attention`` (``csrc/decode_attention.cpp``): the dense decode cache's attention
  (:mod:`yutu.engine.decode_cache`); torch's SDPA computes the same and stays the reference.
- ``prefill_attention`` (``csrc/prefill_attention.cpp``): causal attention of a prompt chunk over
  its cached prefix and itself (:func:`yutu.engine.attention.paged_attention`'s prefill spans
  with its sliding window, if any); torch's SDPA is the reference.
- ``write_kv_``, ``fill_slots_``, ``fill_whole_`` (``csrc/kv_copy.cpp``): a step's keys and values
  into the paged cache, its new positions into the dense decode cache's slots, and a sequence new
  to that cache's whole context into its slot; torch's indexed assignment and gather are the
  reference.
- ``greedy_rows`` (``csrc/sampling.cpp``): each logits row's greedy token and log-normaliser, for
  the sampler (:class:`yutu.engine.sampler.Sampler`); torch's ``argmax`` and ``log_softmax`` are
  the reference.
- ``adjust_rows_`` (``csrc/sampling.cpp``): the repetition, frequency and presence penalties of
  a step's penalized rows in one call; :func:`yutu.engine.sampler.adjust_logits` is the reference.
- ``spread_threads`` (``csrc/threads.cpp``): binds each thread of torch's intra-op team to its
  own CPU for a wide step, and gives them their CPUs back after it.
- ``rms_norm``, ``add_rms_norm_``, ``rotary_``, ``silu_mul`` (``csrc/layer_ops.cpp``): a decoder
  layer's elementwise steps, one call each, rounding as the model's torch code does (the
  reference; :class:`yutu.engine.model.LlamaForCausalLM` runs on them when ``ops`` is set).

Tests hold each to its reference. Building needs a C++ compiler and torch's headers (``make``
builds them during set-up, so engines only load them); they are compiled for the CPU they run on
(``-march=native``), into ``$YUTU_CACHE_DIR/kernels`` (default ``~/.cache/yutu/kernels``) under a
name of the torch version, the CPU's flags, the sources' contents and the torch installation: a
cache shared between different machines never hands one the other's code, and every checkout of
the same sources in one virtualenv shares one build (:func:`build_directory`). Engines pick with ``kernels``: ``native`` (fail when they cannot be built),
``torch`` (torch's operations), or ``auto`` (native on CPU where they build, else torch's,
saying why in the log).

Where nothing can compile them (the container image has no compiler), a **portable** build made
ahead (``python -m yutu.engine.native --portable``: ``-march=x86-64-v3``, AVX2 and FMA, so any
x86-64 CPU of the last decade runs it) is loaded instead, from ``kernels/`` beside the machine
builds, when this CPU has what it needs; the image ships one (docs/deployment.md). It lacks what a
machine build takes from its CPU (AVX-512, the bfloat16 pair products), and says so in the log.

``python -m yutu.engine.native`` builds (or loads) them and prints where they are."""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from yutu.config import KERNEL_CHOICES
from yutu.engine.default_model import cache_root
from yutu.engine.loader import cpu_flags

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "kv_copy.cpp",
        "layer_ops.cpp",
        "sampling.cpp",
        "threads.cpp",
        "bindings.cpp",
    )
]
HEADERS = [CSRC / "kernels.h"]  # included by them: hashed and copied with them
# -ffast-math: the dot products and exponentials vectorize only with it (2.5x the kernel's speed at
# one decode, measured against -fno-math-errno alone). It stays in the kernel's object: the link
# step does not get it, so no startup code sets flush-to-zero for the process (a test checks).
# -fopenmp: at::parallel_for splits a kernel over torch's threads only when compiled with it (else
# it runs on the calling thread); the OpenMP runtime is torch's own, which libtorch_cpu loads: the
# link step does not name one, so no second runtime (and thread pool) comes into the process.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# The portable build: x86-64 microarchitecture level 3 (Haswell, Zen 1 and later), and the
# /proc/cpuinfo flags a CPU needs to run it.
PORTABLE_MARCH = "x86-64-v3"
PORTABLE_CFLAGS = ["-O3", f"-march={PORTABLE_MARCH}", "-ffast-math", "-fopenmp"]
PORTABLE_CPU_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})

_lock = threading.Lock()
_loaded: ModuleType | None = None
_failure: str | None = None  # why the build failed (once failed, not tried again in this process)


def build_directory(portable: bool = False) -> Path:
    """Where this machine's build of these sources lives: named by the torch version, the CPU's flags
    and the sources' contents (with the flags and the torch installation built against), so that
    every checkout with the same sources and virtualenv shares one build and a changed source gets
    a new one. Another virtualenv gets its own: torch's builder rebuilds when the include paths it
    compiles with change, so two virtualenvs sharing a directory took turns rebuilding (~50 s each,
    inside an engine's start). ``portable``: the portable build's, named by its -march instead."""
    flags = PORTABLE_CFLAGS if portable else CFLAGS
    code = hashlib.sha256(" ".join([*flags, str(Path(torch.__file__).resolve().parent)]).encode())
    for source in SOURCES + HEADERS:
        code.update(source.read_bytes())
    target = (
        PORTABLE_MARCH if portable else hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    )
    return cache_root() / "kernels" / f"torch-{torch.__version__}-{target}-{code.hexdigest()[:8]}"


def portable_build() -> Path | None:
    """The portable build of these sources, if one was made and this CPU can run it."""
    library = build_directory(portable=True) / "yutu_native.so"
    return library if library.is_file() and PORTABLE_CPU_FLAGS <= cpu_flags() else None


def _compiler() -> str | None:
    """The C++ compiler torch's builder would run (``$CXX``, else ``c++``), if there is one."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _import(library: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("yutu_native", str(library))
    spec = importlib.util.spec_from_file_location("yutu_native", library, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(portable: bool = False) -> ModuleType:
    """The built kernels, building them first when this machine has not yet (~40 s); where nothing
    can compile them, the portable build if there is one; raises :class:`RuntimeError` saying why
    when they cannot be had (no compiler, no headers). ``portable``: build and load the portable
    build (what an image ships)."""
    global _loaded, _failure
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failure is not None:
            raise RuntimeError(_failure)
        directory = build_directory(portable)
        prebuilt = None if portable else portable_build()
        if prebuilt is not None and not (directory / "yutu_native.so").exists() and _compiler() is None:
            _loaded = _import(prebuilt)
            log.info("no C++ compiler here: using the portable native kernels (%s, without this CPU's own "
                     "extensions such as AVX-512) from %s", PORTABLE_MARCH, prebuilt.parent)  # fmt: skip
            return _loaded
        started = time.perf_counter()
        path = os.environ.get("PATH", "")
        # torch runs `ninja` from PATH; the project's (pip's ninja) is beside this interpreter
        os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), path])
        try:
            from torch.utils import cpp_extension  # imports setuptools: only when wanted

            directory.mkdir(parents=True, exist_ok=True)
            # built from a copy in the build directory: torch's builder rebuilds when a source's path
            # changes, and another checkout's path would otherwise make it rebuild each time
            for source in SOURCES + HEADERS:
                copy = directory / source.name
                if not copy.exists() or copy.read_bytes() != source.read_bytes():
                    copy.write_bytes(source.read_bytes())
            _loaded = cpp_extension.load(
                name="yutu_native",
                sources=[str(directory / source.name) for source in SOURCES],
                extra_cflags=PORTABLE_CFLAGS if portable else CFLAGS,
                build_directory=str(directory),
                verbose=False,
            )
        except Exception as e:  # a compiler error, no compiler, no headers, a read-only cache
            lines = [line for line in str(e).splitlines() if line.strip()]  # a compiler's output is long
            why = lines[-1] if lines else ""
            _failure = f"the native kernels could not be built in {directory}: {type(e).__name__}: {why}"
            raise RuntimeError(_failure) from e
        finally:
            os.environ["PATH"] = path
        took = time.perf_counter() - started
        if took > 2.0:
            log.info("built the native kernels in %.0f s (%s)", took, directory)
        return _loaded


def engine_kernels(choice: str, device: torch.device) -> ModuleType | None:
    """The kernels an engine with ``kernels=choice`` on ``device`` uses; None: torch's."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "torch":
        return None
    if device.type != "cpu":
        if choice == "native":
            raise ValueError(f"the native kernels run on CPU only, the engine is on {device}")
        return None
    if choice == "native":
        return load()
    try:
        return load()
    except RuntimeError as e:
        log.warning("%s; the engine runs on torch's operations, slower (kernels auto)", e)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m yutu.engine.native",
        description="Build (or load) the native CPU kernels for this machine and print where they are.",
    )
    parser.add_argument(
        "--portable",
        action="store_true",
        help=f"build the portable kernels instead (-march={PORTABLE_MARCH}), which engines load where"
        " nothing can compile (a container image)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        module = load(portable=args.portable)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"native kernels ready: {module.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
