#!/usr/bin/env bash
# Deploys docker-compose.yml to Docker Swarm as stack $YUTU_STACK (default yutu): merges it with
# deploy/swarm/stack.yml, renders the result for the stack loader (scripts/swarm-render.py) and runs
# `docker stack deploy`. Creates the secrets <stack>_api_key and <stack>_admin_token from
# YUTU_API_KEY and YUTU_ADMIN_TOKEN when they do not exist yet (a random token when unset, printed
# once). The image must be on every node that runs a task (build it there, or push it to a registry
# and set YUTU_IMAGE). Usage: scripts/swarm-deploy.sh [--no-publish]
#   --no-publish: do not publish the gateway's port (reach it from the attachable network instead)
set -euo pipefail
cd "$(dirname "$0")/.."
STACK=${YUTU_STACK:-yutu}
export YUTU_STACK=$STACK

yaml_python() {
  for py in python3 /usr/bin/python3 .venv/bin/python; do
    if "$py" -c 'import yaml' 2>/dev/null; then echo "$py"; return; fi
  done
  echo "swarm-deploy: no python3 with PyYAML (apt-get install python3-yaml)" >&2; return 1
}

secret() {  # secret NAME ENVVAR
  local name="${STACK}_$1" value=${!2:-}
  docker secret inspect "$name" >/dev/null 2>&1 && return 0
  if [[ -z "$value" ]]; then
    value=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')
    echo "swarm-deploy: secret $name created with a random token: $value" >&2
  fi
  printf '%s' "$value" | docker secret create "$name" - >/dev/null
}
secret api_key YUTU_API_KEY
secret admin_token YUTU_ADMIN_TOKEN

if docker compose version >/dev/null 2>&1; then compose="docker compose"; else compose="docker-compose"; fi
rendered=$(mktemp /tmp/yutu-stack.XXXXXX.yml)
trap 'rm -f "$rendered"' EXIT
# the tokens come from the secrets, never from this shell's environment
env -u YUTU_API_KEY -u YUTU_ADMIN_TOKEN $compose -p "$STACK" -f docker-compose.yml -f deploy/swarm/stack.yml config \
  | "$(yaml_python)" scripts/swarm-render.py "$@" >"$rendered"
docker stack deploy --prune -c "$rendered" "$STACK"
