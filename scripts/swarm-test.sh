#!/usr/bin/env bash
# `make swarm-test`: docker-compose.yml deployed to a single-node Docker Swarm (scripts/swarm-deploy.sh)
# serves a streamed chat completion through the overlay network with two decode replicas, the
# gateway demanding the API key from its Swarm secret. The node is labelled for store nodes and
# decode (the stack's placement constraints). Starts dockerd and `docker swarm init` only when
# needed and undoes exactly what it did: `docker stack rm`, the stack's volumes and secrets,
# `docker swarm leave --force`, docker_gwbridge, and dockerd.
set -euo pipefail
cd "$(dirname "$0")/.."
STACK=${YUTU_STACK:-yutuswarm}
export YUTU_STACK=$STACK
source scripts/docker-lib.sh
FILTER="label=com.docker.stack.namespace=$STACK"
API_KEY=$(python3 -c 'import secrets; print(secrets.token_urlsafe(18))')

started=none swarm_made=0 gwbridge_made=0
start_daemon() { started=$(scripts/docker-daemon.sh start); echo "   dockerd: $started" >&2; }
swarm_init() {
  local state
  state=$(docker info -f '{{.Swarm.LocalNodeState}}')
  if [[ "$state" == active ]]; then echo "   this engine is already in a swarm: using it" >&2; return; fi
  docker network inspect docker_gwbridge >/dev/null 2>&1 || gwbridge_made=1
  docker swarm init --advertise-addr 127.0.0.1 --listen-addr 127.0.0.1:2377 >/dev/null
  swarm_made=1
  docker node update --label-add yutu.store=true --label-add yutu.decode=true "$(docker info -f "{{.Swarm.NodeID}}")" >/dev/null
}
stack_down() {
  docker stack rm "$STACK" >/dev/null 2>&1 || true
  local deadline=$(( $(date +%s) + 120 ))
  while [[ -n "$(docker ps -aq --filter "$FILTER")" ]] && [[ $(date +%s) -lt $deadline ]]; do sleep 1; done
  while [[ -n "$(docker network ls -q --filter "$FILTER")" ]] && [[ $(date +%s) -lt $deadline ]]; do sleep 1; done
  docker volume ls -q --filter "$FILTER" | xargs -r docker volume rm >/dev/null
  docker secret rm "${STACK}_api_key" "${STACK}_admin_token" >/dev/null 2>&1 || true
}
swarm_leave() {
  if [[ $swarm_made -eq 1 ]]; then docker swarm leave --force >/dev/null; swarm_made=0; fi
  if [[ $gwbridge_made -eq 1 ]]; then docker network rm docker_gwbridge >/dev/null 2>&1 || true; gwbridge_made=0; fi
}
finish() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "swarm-test: FAILED (exit $rc)" >&2
    docker service ls --filter "$FILTER" >&2 || true
    for s in $(docker service ls -q --filter "$FILTER" 2>/dev/null); do
      docker service ps --no-trunc "$s" 2>&1 | head -4 >&2; docker service logs --tail 15 "$s" >&2 2>&1 || true
    done
  fi
  stack_down; swarm_leave
  [[ "$started" == started ]] && scripts/docker-daemon.sh stop
  exit $rc
}
trap finish EXIT

phase install scripts/docker-install.sh
phase daemon start_daemon
phase build scripts/docker-build.sh -- -q
phase swarm swarm_init
phase deploy env YUTU_API_KEY="$API_KEY" YUTU_DECODE_REPLICAS=2 scripts/swarm-deploy.sh --no-publish
PYRUN="docker run --rm -i --network ${STACK}_default --entrypoint python3 ${YUTU_IMAGE:-yutu:local}"
URL=http://gateway:8000
wait_healthy() {
  wait_containers_healthy "$FILTER" 8 600 --restarts  # redis, master, store node, conductor, prefill, 2 decode, gateway
  wait_gateway_engines "$URL" 1 2 300
}
phase healthy wait_healthy
no_key_refused() {
  local code
  code=$($PYRUN - "$URL" <<'PY'
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(f"{sys.argv[1]}/v1/models", timeout=30)
    print(200)
except urllib.error.HTTPError as exc:
    print(exc.code)
PY
)
  [[ "$code" == 401 ]] || { echo "a request without the API key got $code, not 401" >&2; return 1; }
  echo "   without the API key: 401" >&2
}
phase auth no_key_refused
phase chat check_streaming_chat "$URL" "$API_KEY"
phase down stack_down
phase leave swarm_leave
phase leftovers check_nothing_left "$FILTER"
trap - EXIT
[[ "$started" == started ]] && scripts/docker-daemon.sh stop
print_timings
echo "swarm-test: OK"
