#!/usr/bin/env bash
# Starts a Docker daemon when none answers, and stops only the one it started.
#   scripts/docker-daemon.sh start   # prints "started" (it started dockerd) or "running" (one was up)
#   scripts/docker-daemon.sh stop    # stops the dockerd that `start` started, if any; else nothing
# The pid of a daemon it started is kept in $YUTU_DOCKERD_PIDFILE (default /run/yutu-dockerd.pid),
# its log in /tmp/yutu-dockerd.log.
set -euo pipefail
PIDFILE=${YUTU_DOCKERD_PIDFILE:-/run/yutu-dockerd.pid}
LOG=/tmp/yutu-dockerd.log

up() { timeout 10 docker info >/dev/null 2>&1; }

case "${1:-}" in
  start)
    if up; then echo running; exit 0; fi
    command -v dockerd >/dev/null || { echo "docker-daemon: dockerd is missing (scripts/docker-install.sh)" >&2; exit 1; }
    [[ $(id -u) -eq 0 ]] || { echo "docker-daemon: no Docker daemon answers and starting one needs root" >&2; exit 1; }
    setsid dockerd >"$LOG" 2>&1 < /dev/null &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 120); do
      if up; then echo started; exit 0; fi
      if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then break; fi
      sleep 0.5
    done
    echo "docker-daemon: dockerd did not come up; the end of $LOG:" >&2
    tail -20 "$LOG" >&2
    exit 1
    ;;
  stop)
    [[ -f "$PIDFILE" ]] || exit 0
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$PIDFILE"
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
