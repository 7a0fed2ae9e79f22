#!/bin/sh
# Entry point of the Yutu image: runs `yutu "$@"` (the command picks the role: gateway, decode, ...).
# Secrets as files: every YUTU_<NAME>_FILE variable (a Docker Swarm or Kubernetes secret mounted as a
# file) becomes YUTU_<NAME> holding that file's content (trailing newlines dropped), so a token sits
# neither in the service definition nor in argv. A named file that cannot be read stops the container.
set -eu
for name in $(env | sed -n 's/^\(YUTU_[A-Z0-9_]*\)_FILE=.*/\1/p'); do
  file=$(printenv "${name}_FILE")
  if [ ! -r "$file" ]; then
    echo "yutu-entrypoint: ${name}_FILE=$file is not a readable file (mount the secret there or unset ${name}_FILE)" >&2
    exit 64
  fi
  value=$(cat "$file")
  export "$name=$value"
  unset "${name}_FILE"
done
exec yutu "$@"
