"""deploy/k8s: what the manifests must say, checked structurally (PyYAML; no cluster needed).

`make k8s-check` also validates every resource against Kubernetes' own schemas
(kubernetes-validate from PyPI, schemas bundled, offline). These tests check what a schema cannot:
every workload runs the image's role with probes on the service's /ready and /health, requests
resources, advertises its pod address, the selectors match, the store nodes are a StatefulSet
behind a headless Service, and the gateway has a Service on 8000.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
ROLES = {"store-master", "store-node", "conductor", "prefill", "decode", "gateway"}


def kustomization() -> dict[str, Any]:
    return dict(yaml.safe_load((K8S / "kustomization.yaml").read_text()))


def resources() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in resources() if d["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    return {**by_kind("Deployment"), **by_kind("StatefulSet")}


def test_kustomization_lists_every_manifest_in_the_directory() -> None:
    listed = set(kustomization()["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_every_service_runs_as_a_workload_of_the_one_image_with_its_role_as_command() -> None:
    found = {name: w for name, w in workloads().items() if name in ROLES}
    assert set(found) == ROLES
    images = {w["spec"]["template"]["spec"]["containers"][0]["image"] for w in found.values()}
    assert images == {"yutu"}  # one image; kustomization's `images:` names the tag
    for name, w in found.items():
        assert w["spec"]["template"]["spec"]["containers"][0]["args"] == [name]


def test_stateless_services_are_deployments_and_store_nodes_a_statefulset_behind_a_headless_service() -> None:
    assert set(by_kind("Deployment")) == ROLES - {"store-node"} | {"redis"}
    assert set(by_kind("StatefulSet")) == {"store-node"}
    sts = by_kind("StatefulSet")["store-node"]
    headless = by_kind("Service")[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["YUTU_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("name", sorted(ROLES))
def test_probes_resources_and_advertised_address(name: str) -> None:
    pod = workloads()[name]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe_port = "http" if name == "gateway" else "admin"
    env = {e["name"]: e for e in container["env"]}
    # the port the service's admin app listens on is the port the probes ask
    listen = env[
        "YUTU_GATEWAY_PORT" if name == "gateway" else f"YUTU_{name.replace('-', '_').upper()}_ADMIN_PORT"
    ]
    assert int(listen["value"]) == ports[probe_port]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": probe_port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": probe_port}
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert env["YUTU_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_selectors_match_their_pods_and_the_gateway_is_served_on_8000() -> None:
    for name, w in workloads().items():
        assert (
            w["spec"]["selector"]["matchLabels"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ), name
    pods = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in workloads().items()}
    for name, svc in by_kind("Service").items():
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pods.values()), name
    gateway = by_kind("Service")["gateway"]
    assert [(p["port"], p["targetPort"]) for p in gateway["spec"]["ports"]] == [(8000, "http")]


def test_shared_memory_volumes_hold_what_lives_in_dev_shm() -> None:
    """Store segments and KV caches are registered memory in /dev/shm: a memory volume above their size."""
    mib = {"Mi": 1, "Gi": 1024}
    for name, size_env in (("store-node", "YUTU_STORE_NODE_SEGMENT_SIZE"), ("prefill", "YUTU_PREFILL_KV_CACHE_MEMORY_MIB"),
                           ("decode", "YUTU_DECODE_KV_CACHE_MEMORY_MIB")):  # fmt: skip
        pod = workloads()[name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        limit = volume["emptyDir"]["sizeLimit"]
        assert volume["emptyDir"]["medium"] == "Memory"
        raw = {e["name"]: e.get("value") for e in container["env"]}[size_env]
        need = int(raw.removesuffix("GiB")) * 1024 if raw.endswith("GiB") else int(raw)
        assert int(limit[:-2]) * mib[limit[-2:]] > need, name


def test_tokens_come_from_the_secret_as_files() -> None:
    for name, var, key in (
        ("gateway", "YUTU_API_KEY_FILE", "api_key"),
        ("conductor", "YUTU_ADMIN_TOKEN_FILE", "admin_token"),
    ):
        pod = workloads()[name]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        mount = pod["containers"][0]["volumeMounts"][0]
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "yutu-tokens"
        assert env[var] == f"{mount['mountPath']}/{key}"
