#!/usr/bin/env bash
# Makes sure the base images the Dockerfiles and docker-compose.yml name exist locally: pulls each one,
# and when no registry is reachable builds a stand-in under the same name, so the same Dockerfile and
# compose file work online and offline. Idempotent: an image already present is left alone.
#   debian:bookworm-slim  <- debootstrap --variant=minbase bookworm | docker import
#   redis:7               <- Dockerfiles/redis-local.Dockerfile (Debian's redis-server on that base)
# Usage: scripts/docker-base.sh [--force]   (--force rebuilds the stand-ins even if present)
# Env: DEBIAN_MIRROR (default http://deb.debian.org/debian), BASE_IMAGE, REDIS_IMAGE.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-debian:bookworm-slim}
REDIS_IMAGE=${REDIS_IMAGE:-redis:7}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
force=0
[[ "${1:-}" == "--force" ]] && force=1

have() { [[ $force -eq 0 ]] && docker image inspect "$1" >/dev/null 2>&1; }
pull() { timeout 60 docker pull -q "$1" >/dev/null 2>&1; }

debootstrap_base() {
  # A minimal Debian root file system, trimmed like the official -slim images (no docs, man pages,
  # locales or apt caches; dpkg told to skip them in later installs too).
  command -v debootstrap >/dev/null || { echo "docker-base: debootstrap is missing (scripts/docker-install.sh installs it)" >&2; exit 1; }
  local root
  root=$(mktemp -d /tmp/yutu-debootstrap.XXXXXX)
  trap 'rm -rf "$root"' RETURN
  echo "docker-base: no registry for $BASE_IMAGE: debootstrap --variant=minbase bookworm ($DEBIAN_MIRROR)" >&2
  debootstrap --variant=minbase bookworm "$root" "$DEBIAN_MIRROR" >/tmp/yutu-debootstrap.log 2>&1 || {
    tail -20 /tmp/yutu-debootstrap.log >&2; exit 1; }
  cat >"$root/etc/dpkg/dpkg.cfg.d/yutu-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
CFG
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$root/etc/apt/apt.conf.d/99yutu-slim"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
         "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/var/log/*.log
  tar -C "$root" -c . | docker import --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
  echo "docker-base: built $BASE_IMAGE locally ($(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | numfmt --to=iec))" >&2
}

if ! have "$BASE_IMAGE"; then
  if [[ $force -eq 0 ]] && pull "$BASE_IMAGE"; then echo "docker-base: pulled $BASE_IMAGE" >&2; else debootstrap_base; fi
fi
if ! have "$REDIS_IMAGE"; then
  if [[ $force -eq 0 ]] && pull "$REDIS_IMAGE"; then echo "docker-base: pulled $REDIS_IMAGE" >&2; else
    echo "docker-base: no registry for $REDIS_IMAGE: building it from $BASE_IMAGE + Debian's redis-server" >&2
    docker build -q --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$REDIS_IMAGE" \
      -f Dockerfiles/redis-local.Dockerfile Dockerfiles >/dev/null
  fi
fi
