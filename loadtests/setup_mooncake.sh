#!/usr/bin/env bash
# Makes the virtualenv that runs the real Mooncake Store as loadtests/bench_store.py's peer
# (loadtests/mooncake_peer.py) and prints its python. A benchmark peer, not a project dependency:
# it lives outside the repository, in $YUTU_MOONCAKE_VENV (default ~/.cache/yutu/mooncake-venv),
# where bench_store.py looks for it.
#
#   bash loadtests/setup_mooncake.sh            # idempotent; needs PyPI and Debian's archive
set -euo pipefail
venv="${YUTU_MOONCAKE_VENV:-$HOME/.cache/yutu/mooncake-venv}"
# the wheel's engine links RDMA and NUMA libraries even when only TCP is used
if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q librdmacm.so.1 || ! ldconfig -p | grep -q libnuma.so.1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  $sudo apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >&2
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" numpy >&2
"$venv/bin/python" -c "from mooncake.store import MooncakeDistributedStore" >&2
echo "$venv/bin/python"
