#!/usr/bin/env bash
# `make compose-test`: the compose stack answers a real streaming chat completion, and `down -v`
# leaves nothing of it behind. Phases (each one timed): install Docker and Compose if missing, start
# dockerd if none runs (and stop it at the end), build the image (base images made locally when no
# registry answers), `up`, wait until every container is healthy and the gateway sees its engines,
# a streamed /v1/chat/completions checked chunk by chunk, on x86-64 that the engines run on the
# image's portable native kernels, that nothing was copied into the models volume (the demo model
# stays in the image), `down -v`, then no container, volume or network of the project may remain.
# On failure it prints the services' logs.
# Env: YUTU_COMPOSE_PROJECT (default yutuci), YUTU_COMPOSE_UP_TIMEOUT (s, default 600).
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${YUTU_COMPOSE_PROJECT:-yutuci}
UP_TIMEOUT=${YUTU_COMPOSE_UP_TIMEOUT:-600}
source scripts/docker-lib.sh

phase install scripts/docker-install.sh
start_daemon() { started=$(scripts/docker-daemon.sh start); echo "   dockerd: $started" >&2; }
started=none
phase daemon start_daemon
COMPOSE=$(compose_cmd)
PORT=$(free_port)
export YUTU_GATEWAY_PUBLISH="127.0.0.1:$PORT"
compose() { $COMPOSE -p "$PROJECT" -f docker-compose.yml "$@"; }

finish() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "compose-test: FAILED (exit $rc); the services' last log lines:" >&2
    compose logs --no-color --tail 40 >&2 || true
  fi
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  [[ "$started" == started ]] && scripts/docker-daemon.sh stop
  exit $rc
}
trap finish EXIT

phase build scripts/docker-build.sh -- -q
phase up compose up -d --quiet-pull
wait_healthy() {
  wait_containers_healthy "label=com.docker.compose.project=$PROJECT" 7 "$UP_TIMEOUT"
  wait_gateway_engines "http://127.0.0.1:$PORT" 1 1 "$UP_TIMEOUT"
}
phase healthy wait_healthy
phase chat check_streaming_chat "http://127.0.0.1:$PORT"
check_kernels() {  # the image's portable kernels (yutu.engine.native), loaded by both engines
  if [[ "$(uname -m)" != x86_64 ]]; then echo "   kernels: $(uname -m) has none (torch's operations)" >&2; return 0; fi
  local service logs
  for service in prefill decode; do
    # Whole logs first: `compose logs | grep -q` fails under pipefail when grep's early exit
    # cuts the pipe (SIGPIPE) before compose has written everything.
    logs=$(compose logs --no-color "$service")
    if ! grep -q "using the portable native kernels" <<<"$logs"; then
      echo "compose-test: the $service engine did not load the image's portable kernels" >&2
      return 1
    fi
  done
}
phase kernels check_kernels
check_models_volume() {  # nothing of the image is copied into the shared models volume (moby#43068)
  local listing
  listing=$(docker run --rm --entrypoint ls -v "${PROJECT}_models:/models" "${YUTU_IMAGE:-yutu:local}" -A /models)
  if [[ -n "$listing" ]]; then
    echo "compose-test: the models volume holds what no one put there: $listing" >&2
    return 1
  fi
}
phase models check_models_volume
phase down compose down -v --remove-orphans
phase leftovers check_nothing_left "label=com.docker.compose.project=$PROJECT"
trap - EXIT
[[ "$started" == started ]] && scripts/docker-daemon.sh stop
print_timings
echo "compose-test: OK"
