#!/usr/bin/env bash
# Installs what Yutu needs from the system on a fresh Debian/Ubuntu machine: python3 with venv, a C++
# compiler and Python's headers (the native CPU kernels, yutu.engine.native), and redis-server. Does nothing for what is already there. Usage: scripts/bootstrap.sh [--need-redis-binary]
#   --need-redis-binary: the tests start their own redis-server, so the binary must exist even when
#                        some Redis is already reachable.
set -euo pipefail

need_binary=0
[[ "${1:-}" == "--need-redis-binary" ]] && need_binary=1

as_root() {
  if [[ $(id -u) -eq 0 ]]; then "$@";
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo "$@";
  else return 1; fi
}

apt_updated=0
apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then return 1; fi
  if [[ $apt_updated -eq 0 ]]; then as_root apt-get update -qq || return 1; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "Yutu needs Python 3.11 or newer as python3 (found: $(python3 --version 2>&1 || echo none))." >&2
  apt_install python3 python3-venv python3-dev || { echo "Install it with: sudo apt-get install python3 python3-venv" >&2; exit 1; }
fi
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  apt_install python3-venv || { echo "python3 cannot create virtualenvs. Install it with: sudo apt-get install python3-venv" >&2; exit 1; }
fi

has_python_headers() { python3 -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' 2>/dev/null; }
if ! command -v g++ >/dev/null 2>&1 || ! has_python_headers; then
  echo "bootstrap: installing g++ and python3-dev (the native CPU kernels)" >&2
  apt_install g++ python3-dev || {
    echo "bootstrap: no C++ compiler or Python headers, and they could not be installed: engines decode" >&2
    echo "  on torch's attention (slower). Install them with: sudo apt-get install g++ python3-dev" >&2
  }
fi

redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }
if ! command -v redis-server >/dev/null 2>&1; then
  if [[ $need_binary -eq 1 ]] || ! redis_up; then
    echo "bootstrap: installing redis-server" >&2
    apt_install redis-server || {
      echo "redis-server is missing and could not be installed (no root/sudo or no apt)." >&2
      echo "Install it with: sudo apt-get install redis-server   (or run a Redis and pass YUTU_REDIS_URL)" >&2
      exit 1
    }
    # Debian starts a system Redis on install; Yutu starts its own when it needs one.
  fi
fi
