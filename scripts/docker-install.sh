#!/usr/bin/env bash
# Installs what the container targets need on a Debian/Ubuntu machine, skipping what is there:
# a Docker engine (Debian's docker.io), Compose (`docker compose` or Debian's docker-compose),
# debootstrap (scripts/docker-base.sh builds base images with it when no registry answers), curl
# and iproute2. Idempotent. Usage: scripts/docker-install.sh
set -euo pipefail

as_root() {
  if [[ $(id -u) -eq 0 ]]; then "$@";
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo "$@";
  else echo "docker-install: need root (or passwordless sudo) to install: ${*: -1}" >&2; return 1; fi
}

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
  missing+=(docker-compose)
fi
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
if [[ ${#missing[@]} -gt 0 ]]; then
  command -v apt-get >/dev/null 2>&1 || { echo "docker-install: no apt-get; install ${missing[*]} by hand" >&2; exit 1; }
  echo "docker-install: installing ${missing[*]}" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
