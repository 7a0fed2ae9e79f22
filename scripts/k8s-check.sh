#!/usr/bin/env bash
# `make k8s-check`: every resource in deploy/k8s validated strictly (unknown fields rejected) against
# Kubernetes' own schemas, with kubernetes-validate from PyPI (its schemas are bundled: no cluster, no
# network after the install), in its own virtualenv build/k8s-venv. tests/deploy/test_k8s_manifests.py
# (part of `make test`) checks what a schema cannot: probes, selectors, ports, secrets, /dev/shm.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=build/k8s-venv
VERSION=1.37.0  # kubernetes-validate; its default Kubernetes version is the same
if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -q "$VERSION"; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "kubernetes-validate==$VERSION"
fi
files=$(ls deploy/k8s/*.yaml | grep -v '/kustomization.yaml$')
"$VENV/bin/kubernetes-validate" --strict --quiet $files
echo "k8s-check: $(echo $files | wc -w) manifests valid against Kubernetes $("$VENV/bin/kubernetes-validate" --help | sed -n 's/.*Defaults to \([0-9.]*\).*/\1/p')"
