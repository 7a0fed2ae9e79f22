"""Print docker-compose.yml merged with deploy/swarm/stack.yml as a file `docker stack deploy` takes.

Reads the merged, interpolated configuration (`docker-compose config` output) on stdin. Swarm's
stack loader validates against the Compose 3.x schema, which rejects some keys compose uses and
ignores others, so this drops or converts them:
  depends_on (health conditions; Swarm starts everything and the services wait for each other)
  build, restart, container_name (Swarm has deploy.restart_policy)
  shm_size -> a tmpfs mount of that size on /dev/shm (store segments and KV caches live there)
  environment entries without a value (compose takes them from the shell when set)
  ports: dropped with --no-publish, else published through the routing mesh as given
Usage: docker-compose -f docker-compose.yml -f deploy/swarm/stack.yml config | python3 scripts/swarm-render.py
"""

from __future__ import annotations

import re
import sys

import yaml

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}


def size_bytes(text: str | int) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", str(text).lower())
    if match is None or match.group(2) not in UNITS:
        raise SystemExit(f"swarm-render: cannot read the size {text!r} (e.g. 512m, 1g)")
    return int(match.group(1)) * UNITS[match.group(2)]


def render(config: dict, publish: bool) -> dict:
    config.pop("name", None)  # docker compose v2 adds the project name; the stack loader refuses it
    for service in config["services"].values():
        for key in ("depends_on", "build", "restart", "container_name"):
            service.pop(key, None)
        env = service.get("environment") or {}
        service["environment"] = {k: str(v) for k, v in env.items() if v is not None}
        if "shm_size" in service:
            mount = {"type": "tmpfs", "target": "/dev/shm", "tmpfs": {"size": size_bytes(service.pop("shm_size"))}}
            service.setdefault("volumes", []).append(mount)
        if not publish:
            service.pop("ports", None)
        deploy = service.setdefault("deploy", {})
        deploy.setdefault("restart_policy", {"condition": "any", "delay": "2s"})
    return config


def main() -> None:
    config = yaml.safe_load(sys.stdin)
    yaml.safe_dump(render(config, publish="--no-publish" not in sys.argv), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
