# Shared by scripts/compose-test.sh and scripts/swarm-test.sh (sourced, not run).
# Timed phases, waits on container health and on the gateway, the streaming chat check.

PYRUN=${PYRUN:-python3}  # what runs the checks' Python (swarm-test: a container on the stack's network)
declare -a TIMINGS=()
PHASE_START=$(date +%s%N)

seconds_since() { local ms=$(( ($(date +%s%N) - $1) / 1000000 )); printf '%d.%d' $((ms / 1000)) $(((ms % 1000) / 100)); }

# phase NAME CMD...: run CMD, record and print how long it took.
phase() {
  local name=$1 t0; shift
  t0=$(date +%s%N)
  echo "== $name" >&2
  "$@"
  TIMINGS+=("$(printf '%-10s %7s s' "$name" "$(seconds_since "$t0")")")
  echo "   $name: $(seconds_since "$t0") s" >&2
}
print_timings() {
  echo "timings:"; printf '  %s\n' "${TIMINGS[@]}"
  printf '  %-10s %7s s\n' total "$(seconds_since "$PHASE_START")"
}

compose_cmd() {
  if docker compose version >/dev/null 2>&1; then echo "docker compose"; else echo "docker-compose"; fi
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_containers_healthy FILTER COUNT TIMEOUT [--restarts]: COUNT containers matching FILTER, all
# running and healthy. A stopped one is a failure, unless --restarts (Swarm replaces failed tasks
# and keeps their stopped containers: then COUNT running healthy ones are enough).
wait_containers_healthy() {
  local filter=$1 want=$2 timeout=$3 restarts=${4:-} deadline states healthy
  deadline=$(( $(date +%s) + timeout ))
  while :; do
    states=$(docker ps -a --filter "$filter" -q | xargs -r docker inspect \
             -f '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}')
    healthy=$(grep -c ' running healthy$' <<<"$states" || true)
    if [[ -n "$restarts" ]]; then
      [[ $healthy -ge $want ]] && return 0
    else
      if [[ $healthy -ge $want ]] && ! grep -qv ' running healthy$' <<<"$states"; then return 0; fi
      if grep -qE ' (exited|dead) ' <<<"$states"; then echo "a container stopped:" >&2; echo "$states" >&2; return 1; fi
    fi
    if [[ $(date +%s) -gt $deadline ]]; then echo "not healthy after ${timeout}s:" >&2; echo "$states" >&2; return 1; fi
    sleep 1
  done
}

# wait_gateway_engines URL PREFILL DECODE TIMEOUT: the gateway's /info shows that many usable instances.
wait_gateway_engines() {
  local url=$1 prefill=$2 decode=$3 timeout=$4
  $PYRUN - "$url" "$prefill" "$decode" "$timeout" <<'PY'
import json, sys, time, urllib.request
url, want_p, want_d, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline, seen = time.monotonic() + timeout, None
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(f"{url}/info", timeout=5) as r:
            info = json.load(r)
        seen = {k: sum(1 for w in info[k] if w["usable"]) for k in ("prefill", "decode")}
        if seen["prefill"] >= want_p and seen["decode"] >= want_d:
            print(f"   gateway sees {seen['prefill']} prefill and {seen['decode']} decode instance(s)", file=sys.stderr)
            sys.exit(0)
    except (OSError, ValueError, KeyError) as exc:
        seen = repr(exc)
    time.sleep(0.5)
sys.exit(f"the gateway at {url} never saw {want_p} prefill + {want_d} decode usable instances (last: {seen})")
PY
}

# check_streaming_chat URL [API_KEY]: a streamed chat completion: SSE chunks of one id, content,
# exactly one finish_reason on the last choice chunk, then [DONE]. Prints the text. Greedy: the
# demo model's random weights give its stop tokens ~0.09% of a sampled first token (9 of 10,000
# streams had no content), which failed a CI run; greedy picks the same token every time. A 503 (an
# instance still starting: the gateway says which and to retry) is retried for 30 s, each one
# printed with its body; any other error fails at once, with its body.
check_streaming_chat() {
  $PYRUN - "$1" "${2:-}" <<'PY'
import json, sys, time, urllib.error, urllib.request
url, key = sys.argv[1], sys.argv[2]
auth = {"Authorization": f"Bearer {key}"} if key else {}
models = urllib.request.Request(f"{url}/v1/models", headers=auth)
body = {"model": json.load(urllib.request.urlopen(models, timeout=30))["data"][0]["id"],
        "messages": [{"role": "user", "content": "Hello from the compose test"}],
        "max_tokens": 16, "temperature": 0, "stream": True}
headers = {"Content-Type": "application/json", **auth}
req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
deadline = time.monotonic() + 30
while True:
    try:
        reply = urllib.request.urlopen(req, timeout=120)
        break
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        if exc.code != 503 or time.monotonic() > deadline:
            sys.exit(f"chat completion failed: HTTP {exc.code}: {text}")
        print(f"   503 (retrying): {text}", file=sys.stderr)
        time.sleep(1)
with reply:
    assert reply.status == 200, reply.status
    assert reply.headers["content-type"].startswith("text/event-stream"), reply.headers["content-type"]
    lines = [l.decode().rstrip("\r\n") for l in reply]
data = [l[len("data: "):] for l in lines if l.startswith("data: ")]
assert data and data[-1] == "[DONE]", f"stream did not end with [DONE]: {data[-3:]}"
chunks = [json.loads(d) for d in data[:-1]]
assert chunks, "no chunks before [DONE]"
assert {c["id"] for c in chunks} == {chunks[0]["id"]}, "chunks of several ids"
assert all(c["object"] == "chat.completion.chunk" for c in chunks)
choices = [ch for c in chunks for ch in c["choices"]]
text = "".join(ch["delta"].get("content") or "" for ch in choices)
finishes = [ch["finish_reason"] for ch in choices if ch.get("finish_reason")]
assert text, "no content in the stream"
assert finishes in (["length"], ["stop"]), f"finish_reason: {finishes}"
print(f"   streamed {len(chunks)} chunks, finish_reason={finishes[0]}, text={text!r}", file=sys.stderr)
PY
}

# check_nothing_left FILTER: no container, volume or network matches FILTER.
check_nothing_left() {
  local left
  left="$(docker ps -aq --filter "$1")$(docker volume ls -q --filter "$1")$(docker network ls -q --filter "$1")"
  if [[ -n "$left" ]]; then
    echo "left behind ($1):" >&2
    docker ps -a --filter "$1" >&2; docker volume ls --filter "$1" >&2; docker network ls --filter "$1" >&2
    return 1
  fi
  echo "   no container, volume or network left" >&2
}
