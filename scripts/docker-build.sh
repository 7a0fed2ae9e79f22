#!/usr/bin/env bash
# Builds the Yutu runtime image (Dockerfiles/yutu.Dockerfile) as $YUTU_IMAGE (default yutu:local).
# Makes the base images first when no registry is reachable (scripts/docker-base.sh), and picks
# where the CPU build of torch comes from:
#   --wheels DIR (or YUTU_WHEELS_DIR): a local directory holding torch-<version>+cpu-cp311-*.whl;
#   otherwise PyTorch's CPU index when it answers, else the first pip find-links directory of this
#   machine (`pip config list`) that holds that wheel.
# The directory becomes the Dockerfile's `wheels` stage: packed into a scratch image (yutu-wheels:local)
# passed as --build-arg WHEELS, which works with the classic builder and BuildKit alike.
# Usage: scripts/docker-build.sh [--wheels DIR] [--cuda cu128] [-- extra docker build args]
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${YUTU_IMAGE:-yutu:local}
WHEELS_DIR=${YUTU_WHEELS_DIR:-}
TORCH_INDEX=${YUTU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_VERSION=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml)
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS_DIR=$2; shift 2 ;;
    --cuda) TORCH_INDEX="https://download.pytorch.org/whl/$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: $0 [--wheels DIR] [--cuda cu128] [-- docker build args]" >&2; exit 2 ;;
  esac
done
[[ -n "$TORCH_VERSION" ]] || { echo "docker-build: no torch==X pin in pyproject.toml" >&2; exit 1; }

# The classic builder when the buildx plugin is missing (Debian's docker.io has none).
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

scripts/docker-base.sh

# Local CA certificates, for a TLS-intercepting proxy on the way to PyPI (build stage only).
rm -f Dockerfiles/ca/*.crt
for crt in /usr/local/share/ca-certificates/*.crt; do [[ -f "$crt" ]] && cp "$crt" Dockerfiles/ca/; done

wheel_in() { compgen -G "$1/torch-${TORCH_VERSION}+cpu-cp311-*.whl" | head -1; }
if [[ -z "$WHEELS_DIR" ]] && ! timeout 10 curl -sfI "$TORCH_INDEX/torch/" >/dev/null 2>&1; then
  links=$(python3 -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | tr ' ' '\n')
  for dir in $links /opt/wheels; do
    dir=${dir#file://}
    if [[ -d "$dir" ]] && [[ -n "$(wheel_in "$dir")" ]]; then WHEELS_DIR=$dir; break; fi
  done
  [[ -n "$WHEELS_DIR" ]] || {
    echo "docker-build: $TORCH_INDEX is unreachable and no torch-${TORCH_VERSION}+cpu wheel was found;" >&2
    echo "  pass --wheels DIR (a directory holding torch-${TORCH_VERSION}+cpu-cp311-*.whl)" >&2; exit 1; }
fi

args=(--build-arg "TORCH_INDEX=$TORCH_INDEX" --build-arg "TORCH_VERSION=$TORCH_VERSION")
if [[ -n "$WHEELS_DIR" ]]; then
  wheel=$(wheel_in "$WHEELS_DIR")
  [[ -n "$wheel" ]] || { echo "docker-build: no torch-${TORCH_VERSION}+cpu-cp311-*.whl in $WHEELS_DIR" >&2; exit 1; }
  ctx=$(mktemp -d /tmp/yutu-wheels.XXXXXX)
  trap 'rm -rf "$ctx"' EXIT
  ln "$wheel" "$ctx/" 2>/dev/null || cp "$wheel" "$ctx/"
  printf 'FROM scratch\nCOPY *.whl /\n' >"$ctx/Dockerfile"
  echo "docker-build: torch from $wheel" >&2
  docker build -q -t yutu-wheels:local "$ctx" >/dev/null
  args+=(--build-arg WHEELS=yutu-wheels:local)
else
  echo "docker-build: torch from $TORCH_INDEX" >&2
fi
docker build --force-rm "${args[@]}" "${extra[@]}" -f Dockerfiles/yutu.Dockerfile -t "$IMAGE" .
echo "docker-build: $IMAGE is $(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=si --suffix=B)" >&2
