"""deploy/kubernetes: rendered by the real `kubectl kustomize`, every built-in object validated
against the Kubernetes OpenAPI schemas (kubernetes-validate, offline, strict), the Prometheus
Operator objects against the CRD field names, the PrometheusRule identical to alerts/, and the
properties the issue asks of the DaemonSet checked one by one."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from exporter import __version__
from exporter.config import build as build_config
from helpers.tools import tool

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
KUSTOMIZATION = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
# Versions the objects must be valid for: the newest the package knows and an older one still
# in wide use (runtimeClassName, seccompProfile, sizeLimit are all older than that).
KUBERNETES_VERSIONS = [kubernetes_validate.latest_version(), "1.29"]
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def load_resources() -> list[dict]:
    """Every object of every file the kustomization lists, as written (no kustomize)."""
    docs = []
    for name in KUSTOMIZATION["resources"]:
        docs += [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    result = subprocess.run([tool("kubectl"), "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> dict:
    [obj] = [d for d in docs if d["kind"] == kind]
    return obj


# -- rendering and schemas -----------------------------------------------------------------------
def test_every_listed_resource_exists_and_parses():
    assert KUSTOMIZATION["resources"], "kustomization lists nothing"
    for name in KUSTOMIZATION["resources"]:
        assert (KUBE / name).is_file(), name
    kinds = sorted(d["kind"] for d in load_resources())
    assert kinds == sorted(["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
                            "DaemonSet", "Service", "ServiceMonitor", "PrometheusRule"])


def test_no_manifest_is_left_out_of_the_kustomization():
    on_disk = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == set(KUSTOMIZATION["resources"])


@pytest.mark.integration
def test_kustomize_renders_every_object_into_the_namespace(rendered):
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == \
        sorted((d["kind"], d["metadata"]["name"]) for d in load_resources())
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for d in rendered:
        if d["kind"] not in cluster_scoped:
            assert d["metadata"]["namespace"] == KUSTOMIZATION["namespace"], d["kind"]
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpu-memory-exporter"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.integration
def test_every_builtin_object_is_valid_for_kubernetes(rendered, version):
    builtin = [d for d in rendered if d["kind"] not in CRD_KINDS]
    assert len(builtin) == 7
    for obj in builtin:
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError


@pytest.mark.parametrize("mutate", [
    lambda ds: ds["spec"]["template"]["spec"].update(hostPid=True),  # misspelt field: strict rejects it
    lambda ds: ds["spec"]["template"]["spec"]["containers"][0].update(ports=[{"containerPort": "9842"}]),
    lambda ds: ds["spec"].pop("selector"),
], ids=["unknown-field", "wrong-type", "missing-required"])
@pytest.mark.integration
def test_the_validation_can_fail(rendered, mutate):
    ds = yaml.safe_load(yaml.safe_dump(by_kind(rendered, "DaemonSet")))
    mutate(ds)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, kubernetes_validate.latest_version(), strict=True)


# The Prometheus Operator CRDs, monitoring.coreos.com/v1: the field names, types and patterns of
# the parts these manifests use (from the operator's CRDs; unknown fields are rejected, as the
# API server's structural schema prunes them silently, which would lose them without a word).
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
LABEL_NAME = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                           "labels": STR_MAP, "annotations": STR_MAP}}
RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                        "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                        "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                        "dropequal", "DropEqual"]},
    "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": LABEL_NAME}},
    "separator": {"type": "string"}, "targetLabel": {"type": "string"}, "regex": {"type": "string"},
    "modulus": {"type": "integer"}, "replacement": {"type": "string"}}}
LABEL_SELECTOR = {"type": "object", "additionalProperties": False,
                  "properties": {"matchLabels": STR_MAP, "matchExpressions": {"type": "array"}}}
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": METADATA,
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                 "properties": {
                     "selector": LABEL_SELECTOR, "jobLabel": {"type": "string"},
                     "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                         "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False, "properties": {
                             "port": {"type": "string"}, "path": {"type": "string"},
                             "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                             "interval": {"type": "string", "pattern": DURATION},
                             "scrapeTimeout": {"type": "string", "pattern": DURATION},
                             "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                             "relabelings": {"type": "array", "items": RELABEL},
                             "metricRelabelings": {"type": "array", "items": RELABEL}}}}}}}}
PROMETHEUS_RULE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": METADATA,
        "spec": {"type": "object", "additionalProperties": False, "properties": {"groups": {
            "type": "array", "items": {
                "type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": DURATION},
                    "query_offset": {"type": "string", "pattern": DURATION},
                    "limit": {"type": "integer"}, "labels": STR_MAP,
                    "partial_response_strategy": {"type": "string"},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                        "properties": {
                            "record": {"type": "string"}, "alert": {"type": "string"},
                            "expr": {"type": ["string", "integer"]},
                            "for": {"type": "string", "pattern": DURATION},
                            "keep_firing_for": {"type": "string", "pattern": DURATION},
                            "labels": STR_MAP, "annotations": STR_MAP}}}}}}}}}}
CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PrometheusRule": PROMETHEUS_RULE}


@pytest.mark.parametrize("kind", sorted(CRD_KINDS))
@pytest.mark.integration
def test_prometheus_operator_objects_have_the_crd_shape(rendered, kind):
    jsonschema.validate(by_kind(rendered, kind), CRD_SCHEMAS[kind])


@pytest.mark.parametrize("kind, mutate", [
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(targetPort_name="metrics")),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds")),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0]["relabelings"][0].update(action="rename")),
    ("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].update(alert="X")),  # record and alert
    ("PrometheusRule", lambda o: o["spec"]["groups"][0].pop("name")),
])
@pytest.mark.integration
def test_the_crd_shape_check_can_fail(rendered, kind, mutate):
    obj = yaml.safe_load(yaml.safe_dump(by_kind(rendered, kind)))
    mutate(obj)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, CRD_SCHEMAS[kind])


# -- one source of truth for the rules -----------------------------------------------------------
@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("kube_generate", KUBE / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prometheus_rule_is_what_the_generator_writes(generator):
    assert (KUBE / "prometheusrule.yaml").read_text() == generator.render(), \
        "run `python deploy/kubernetes/generate.py`: prometheusrule.yaml differs from alerts/"


def test_prometheus_rule_carries_every_rule_of_alerts_unchanged():
    rules = yaml.safe_load((REPO / "alerts" / "gpu-memory-exporter.rules.yml").read_text())
    obj = by_kind(load_resources(), "PrometheusRule")
    assert obj["spec"]["groups"] == rules["groups"]


@pytest.mark.integration
def test_generator_check_mode_detects_drift(generator, tmp_path):
    rules = yaml.safe_load((REPO / "alerts" / "gpu-memory-exporter.rules.yml").read_text())
    rules["groups"][0]["rules"][0]["expr"] = "vector(0.5)"
    edited = tmp_path / "rules.yml"
    edited.write_text(yaml.safe_dump(rules))
    assert generator.render(edited) != (KUBE / "prometheusrule.yaml").read_text()
    result = subprocess.run([sys.executable, str(KUBE / "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr  # the committed file is current


# -- what the DaemonSet must be ------------------------------------------------------------------
@pytest.fixture(scope="module")
def pod(rendered) -> dict:
    return by_kind(rendered, "DaemonSet")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    [c] = pod["containers"]
    return c


@pytest.mark.integration
def test_daemonset_shares_the_host_pid_namespace_and_reads_proc_read_only(pod, container, rendered):
    assert pod["hostPID"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    proc = next(name for name, v in volumes.items() if v.get("hostPath", {}).get("path") == "/proc")
    assert mounts[proc]["readOnly"] is True
    host_paths = {name: v["hostPath"]["path"] for name, v in volumes.items() if "hostPath" in v}
    assert set(host_paths.values()) == {"/proc", "/run/gpumem-probe"}, "/proc and the probes' directory only"
    assert all(mounts[name]["readOnly"] is True for name in host_paths)
    config = yaml.safe_load(by_kind(rendered, "ConfigMap")["data"]["config.yaml"])
    assert config["host"]["proc_root"] == mounts[proc]["mountPath"]
    probes = next(name for name, path in host_paths.items() if path == "/run/gpumem-probe")
    assert config["allocator"]["probe_dir"] == mounts[probes]["mountPath"]


@pytest.mark.integration
def test_the_configmap_is_a_valid_exporter_configuration(rendered, pod, container, tmp_path):
    data = yaml.safe_load(by_kind(rendered, "ConfigMap")["data"]["config.yaml"])
    data["allocator"]["probe_dir"] = str(tmp_path)  # the node's directory, which the DaemonSet creates
    config = build_config(data)
    assert config.kubelet.enabled == "auto" and config.host.read_cmdline is False
    config_mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    assert container["args"] == ["run", "--config", f"{config_mount}/config.yaml"]
    port = int(config.listen.rsplit(":", 1)[1])
    health_port = int(config.health_listen.rsplit(":", 1)[1])
    assert container["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"},
                                  {"name": "health", "containerPort": health_port, "protocol": "TCP"}]


@pytest.mark.integration
def test_gpus_come_from_the_nvidia_runtime_not_a_gpu_request(pod, container):
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    resources = container["resources"]
    assert not any(k.startswith("nvidia.com/") for part in resources.values() for k in part), \
        "requesting a GPU would take it from the workloads and hide the others"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


@pytest.mark.integration
def test_kubelet_address_comes_from_the_downward_api(container):
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["NODE_IP"] == "status.hostIP" and env["NODE_NAME"] == "spec.nodeName"


@pytest.mark.integration
def test_resources_have_requests_and_limits(container):
    res = container["resources"]
    for key in ("cpu", "memory"):
        assert key in res["requests"] and key in res["limits"]


@pytest.mark.integration
def test_probes_check_healthz_on_the_health_port(container):
    # The health listener needs no credentials, so the probes work with basic auth on.
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    # Liveness gives a slow start and a stuck NVML call time before a restart.
    live = container["livenessProbe"]
    assert live["initialDelaySeconds"] >= 30 and live["periodSeconds"] * live["failureThreshold"] >= 60


@pytest.mark.integration
def test_runs_non_root_read_only_without_capabilities(pod, container):
    assert pod["securityContext"]["runAsNonRoot"] is True
    dockerfile_uid = re.search(r"useradd .*--uid (\d+)", (REPO / "Dockerfile").read_text()).group(1)
    assert pod["securityContext"]["runAsUser"] == int(dockerfile_uid)
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc


@pytest.mark.integration
def test_image_tag_is_the_package_version(rendered, container):
    assert container["image"] == f"gpu-memory-exporter:{__version__}"


# -- the objects reference each other correctly ---------------------------------------------------
@pytest.mark.integration
def test_rbac_grants_only_get_on_nodes_proxy(rendered):
    role = by_kind(rendered, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes/proxy"], "verbs": ["get"]}]
    binding = by_kind(rendered, "ClusterRoleBinding")
    sa = by_kind(rendered, "ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]


@pytest.mark.integration
def test_service_and_servicemonitor_find_the_pods(rendered, pod):
    ds = by_kind(rendered, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pod["serviceAccountName"] == by_kind(rendered, "ServiceAccount")["metadata"]["name"]
    service = by_kind(rendered, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["clusterIP"] == "None"
    monitor = by_kind(rendered, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    # job = the Service's name: the rule GpuMemoryExporterDown selects that job.
    rules = (REPO / "alerts" / "gpu-memory-exporter.rules.yml").read_text()
    assert 'up{job="' + service["metadata"]["name"] + '"}' in rules


@pytest.mark.integration
def test_servicemonitor_keeps_the_exporters_own_pod_and_endpoint_labels(rendered):
    """The operator's target labels (pod, namespace, container, endpoint) would overwrite the
    exporter's labels for the GPU process's pod and the vLLM endpoint: they are dropped, and
    instance becomes the node's name."""
    [endpoint] = by_kind(rendered, "ServiceMonitor")["spec"]["endpoints"]
    relabel = endpoint["relabelings"]
    drops = [r for r in relabel if r.get("action") == "labeldrop"]
    assert drops and all(re.fullmatch(drops[0]["regex"], name)
                         for name in ("pod", "namespace", "container", "endpoint", "service"))
    assert not re.fullmatch(drops[0]["regex"], "instance")
    targets = {r["targetLabel"]: r["sourceLabels"] for r in relabel if r.get("action") == "replace"}
    assert targets == {"instance": ["__meta_kubernetes_pod_node_name"], "node": ["__meta_kubernetes_pod_node_name"]}


def test_the_generators_answer_help_without_writing():
    # A newcomer's `generate.py --help` rewrote prometheusrule.yaml instead of printing its usage.
    repo = Path(__file__).resolve().parent.parent
    for script in ("deploy/kubernetes/generate.py", "grafana/generate.py", "alerts/generate.py"):
        proc = subprocess.run([sys.executable, str(repo / script), "--help"], capture_output=True, text=True,
                              cwd=repo, env={"PYTHONPATH": str(repo)}, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("usage:"), (script, proc.stderr)
        assert "wrote" not in proc.stdout, script
