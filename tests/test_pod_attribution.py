"""Pod attribution end to end: /proc/<pid>/cgroup text of every runtime and cgroup layout a
Kubernetes node shows -> pod UID -> the kubelet's pod list (a real loopback server) -> the pod
name and namespace on each GPU process; and absent, without error, outside Kubernetes."""
from __future__ import annotations

import json
import os

import pytest

from exporter.clock import FixedClock
from exporter.config import ConfigError
from exporter.config import build as build_config
from exporter.model import GpuSample, ProcessSample, Snapshot
from exporter.runtime import Host, kubelet_pods, make_sampler
from exporter.sim.host import SimulatedHost
from exporter.sim.scenario import from_dict
from exporter.sources.cgroup import parse_cgroup
from exporter.sources.gpu import backend
from exporter.sources.host import LocalHost, enrich
from exporter.sources.kubelet import KubeletPods, KubeletSource, pod_name
from helpers.kubelet import Kubelet, pod_item, pod_list

CID = "3f4e" * 16
UID = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"
U_ = UID.replace("-", "_")  # the systemd cgroup driver writes the UID with underscores
OUTER = "9a" * 32  # a kind/minikube node container around the kubelet

# (name, /proc/<pid>/cgroup text) for a process in pod UID, container CID.
IN_POD = [
    ("v2 systemd containerd burstable",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope\n"),
    ("v2 systemd containerd guaranteed",
     f"0::/kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID}.scope\n"),
    ("v2 systemd CRI-O besteffort",
     f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice/crio-{CID}.scope\n"),
    ("v2 systemd Docker (cri-dockerd)",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/docker-{CID}.scope\n"),
    ("v2 cgroupfs containerd",
     f"0::/kubepods/burstable/pod{UID}/{CID}\n"),
    ("v2 kind node (kubelet nested in a Docker container)",
     f"0::/system.slice/docker-{OUTER}.scope/kubelet.slice/kubelet-kubepods.slice/"
     f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{U_}.slice/cri-containerd-{CID}.scope\n"),
    ("v1 cgroupfs containerd",
     "".join(f"{n}:{c}:/kubepods/burstable/pod{UID}/{CID}\n"
             for n, c in ((12, "pids"), (11, "memory"), (4, "devices"), (2, "cpu,cpuacct")))
     + f"1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n0::/\n"),
    ("v1 systemd containerd",
     f"11:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope\n"
     f"1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope\n"),
    ("v1 systemd CRI-O",
     f"10:devices:/kubepods.slice/kubepods-pod{U_}.slice/crio-{CID}.scope\n"
     f"9:memory:/kubepods.slice/kubepods-pod{U_}.slice/crio-{CID}.scope\n"),
    ("v1 cgroupfs Docker (dockershim)",
     f"11:memory:/kubepods/besteffort/pod{UID}/{CID}\n3:cpuset:/kubepods/besteffort/pod{UID}/{CID}\n"),
]
OUTSIDE = [
    ("v2 Docker without Kubernetes", f"0::/system.slice/docker-{CID}.scope\n", CID),
    ("v1 Docker without Kubernetes", f"11:memory:/docker/{CID}\n4:devices:/docker/{CID}\n", CID),
    ("v2 Podman", f"0::/machine.slice/libpod-{CID}.scope/container\n", CID),
    ("a systemd service", "0::/system.slice/vllm.service\n", ""),
    ("a login session", "0::/user.slice/user-1000.slice/session-3.scope\n", ""),
    ("unreadable", "", ""),
]


def pod_identity(cgroup_text, pods):
    """(container id, pod UID, pod name, namespace) as the host and kubelet sources find them."""
    container, uid = parse_cgroup(cgroup_text)
    pod, namespace = pod_name(pods, uid) if pods is not None else ("", "")
    return container, uid, pod, namespace


def with_pod_names(gpus, pods):
    """The kubelet source over what enrich() filled in."""
    return KubeletSource(pods).collect(Snapshot(timestamp=0.0, gpus=gpus)).snapshot.gpus


@pytest.fixture
def kubelet():
    k = Kubelet()
    k.body = json.dumps(pod_list(pod_item(UID, "llama-70b-0", "inference"),
                                 pod_item("0a0b0c0d-1111-2222-3333-444455556666", "other", "default"))).encode()
    yield k
    k.close()


@pytest.fixture
def pods(kubelet):
    p = KubeletPods(kubelet.url, now=FixedClock(1_000_000.0).now)
    yield p
    p.close()


@pytest.mark.parametrize("text", [t for _, t in IN_POD], ids=[n for n, _ in IN_POD])
def test_process_in_a_pod_gets_its_pod_name_and_namespace(text, pods):
    assert pod_identity(text, pods) == (CID, UID, "llama-70b-0", "inference")


@pytest.mark.parametrize("text, container", [(t, c) for _, t, c in OUTSIDE], ids=[n for n, _, _ in OUTSIDE])
def test_process_outside_any_pod_asks_the_kubelet_nothing(text, container, pods, kubelet):
    assert pod_identity(text, pods) == (container, "", "", "")
    assert kubelet.requests == []


@pytest.mark.parametrize("text", [t for _, t in IN_POD], ids=[n for n, _ in IN_POD])
def test_without_the_kubelet_the_pod_uid_is_still_known(text):
    assert pod_identity(text, None) == (CID, UID, "", "")


def test_pod_the_kubelet_does_not_know_keeps_its_uid_only(pods):
    text = IN_POD[0][1].replace(U_, "ffffffff_ffff_ffff_ffff_ffffffffffff")
    assert pod_identity(text, pods) == (CID, "ffffffff-ffff-ffff-ffff-ffffffffffff", "", "")


def test_kubelet_down_leaves_names_empty_without_raising(kubelet, pods):
    kubelet.status = 503
    assert pod_identity(IN_POD[0][1], pods) == (CID, UID, "", "")
    assert [e.kind for e in pods.take_errors()] == ["http_status"]


# -- through enrich() and the kubelet source, as the sampler runs them every tick --------------
SCENARIO = {
    "name": "pods", "description": "two pods and a bare process", "duration": 600,
    "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory": "80GiB", "count": 2}],
    "host": {"memory": "512GiB"},
    "processes": [
        {"pid": 1000, "name": "python3", "gpu": [0, 1], "memory": "30GiB", "container": CID,
         "pod_uid": UID, "qos": "burstable", "namespace": "inference"},
        {"pid": 2000, "name": "trainer", "gpu": 1, "memory": "4GiB", "container": "ab" * 32,
         "pod_uid": "0a0b0c0d-1111-2222-3333-444455556666", "qos": "guaranteed"},
        {"pid": 3000, "name": "notebook", "gpu": 0, "memory": "1GiB"},
    ],
}


def gpus_from_nvml_view():
    """What the NVML source hands enrich(): PIDs and bytes only."""
    return (GpuSample(index="0", uuid="GPU-0", processes=(ProcessSample(1000, 30 << 30), ProcessSample(3000, 1 << 30))),
            GpuSample(index="1", uuid="GPU-1", processes=(ProcessSample(1000, 30 << 30), ProcessSample(2000, 4 << 30))))


def test_enrich_labels_every_gpu_process_with_its_pod(pods, kubelet):
    host = SimulatedHost(from_dict(SCENARIO), FixedClock(1_000_000.0, at=60))
    gpus = with_pod_names(enrich(gpus_from_nvml_view(), host), pods)
    by = {(g.index, p.pid): p for g in gpus for p in g.processes}
    assert [(by[k].pod, by[k].namespace, by[k].container) for k in [("0", 1000), ("1", 1000)]] == \
        [("llama-70b-0", "inference", CID[:12])] * 2  # one process on two GPUs: same identity
    assert (by["1", 2000].pod, by["1", 2000].namespace, by["1", 2000].pod_uid) == \
        ("other", "default", "0a0b0c0d-1111-2222-3333-444455556666")
    assert (by["0", 3000].pod, by["0", 3000].namespace, by["0", 3000].pod_uid) == ("", "", "")
    assert by["0", 3000].name == "notebook"
    assert len(kubelet.requests) == 1, "one pod list serves every process of the tick"


def test_enrich_outside_kubernetes_fills_no_pod_names():
    host = SimulatedHost(from_dict(SCENARIO), FixedClock(1_000_000.0, at=60))
    gpus = enrich(gpus_from_nvml_view(), host)
    assert {(p.pod, p.namespace) for g in gpus for p in g.processes} == {("", "")}
    assert {p.pod_uid for g in gpus for p in g.processes} == {UID, "0a0b0c0d-1111-2222-3333-444455556666", ""}


def test_the_runtime_runs_the_pod_lookup_as_the_kubelet_source(pods, kubelet):
    """Host(pods=...) is how the runtime wires it: the sampler runs it after the host source.
    This test's own process is in no pod, so the kubelet is not even asked."""
    host = Host(gpu=backend("nvml"), gpu_library=None, view=LocalHost(), clock=FixedClock(1_000_000.0), pods=pods)
    sampler = make_sampler(build_config(), host)
    assert [s.name for s in sampler.sources] == ["nvml", "host", "kubelet"]
    gpus = enrich((GpuSample(index="0", uuid="GPU-0", processes=(ProcessSample(os.getpid(), 1 << 20),)),), host.view)
    proc = with_pod_names(gpus, pods)[0].processes[0]
    assert proc.name and (proc.pod, proc.namespace) == ("", "")
    assert sampler.sources[2].pods is pods
    assert kubelet.requests == []


def test_a_broken_lookup_object_never_stops_the_kubelet_source():
    class Exploding:
        def lookup(self, uid):
            raise RuntimeError("boom")

    assert pod_identity(IN_POD[0][1], Exploding()) == (CID, UID, "", "")


# -- configuration and wiring -------------------------------------------------------------------
def test_kubelet_disabled_outside_kubernetes_by_default():
    assert kubelet_pods(build_config(), env={}) is None


def test_kubelet_auto_in_a_pod_uses_the_node_address(tmp_path):
    token = tmp_path / "token"
    token.write_text("t")
    config = build_config({"kubelet": {"token_file": str(token), "ca_file": ""}})
    pods = kubelet_pods(config, env={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "NODE_IP": "10.0.0.7"})
    assert pods.url == "https://10.0.0.7:10250/pods" and pods.token_file == str(token)
    assert kubelet_pods(config, env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) is None  # no node address


def test_read_only_port_gets_no_token(kubelet):
    config = build_config({"kubelet": {"enabled": True, "url": kubelet.url, "refresh_seconds": 30,
                                       "unknown_pod_refresh_seconds": 5}})
    pods = kubelet_pods(config, env={})
    assert pods.token_file is None and (pods.refresh_seconds, pods.unknown_refresh_seconds) == (30, 5)
    assert pods.lookup(UID).name == "llama-70b-0"
    assert kubelet.requests[0]["authorization"] is None


def test_kubelet_can_be_switched_off_in_kubernetes(tmp_path):
    token = tmp_path / "token"
    token.write_text("t")
    config = build_config({"kubelet": {"enabled": False, "token_file": str(token)}})
    assert kubelet_pods(config, env={"KUBERNETES_SERVICE_HOST": "x", "NODE_NAME": "n"}) is None


@pytest.mark.parametrize("section, message", [
    ({"enabled": "sometimes"}, "kubelet.enabled"),
    ({"url": "kubelet:10250"}, "kubelet.url"),
    ({"refresh_seconds": 0}, "kubelet.refresh_seconds"),
    ({"refresh_seconds": 5, "unknown_pod_refresh_seconds": 10}, "kubelet.unknown_pod_refresh_seconds"),
    ({"timeout_seconds": -1}, "kubelet.timeout_seconds"),
    ({"max_response_bytes": "12"}, "kubelet.max_response_bytes"),
    ({"insecure_skip_verify": "yes"}, "kubelet.insecure_skip_verify"),
    ({"node": "x"}, "kubelet.node: unknown key"),
])
def test_bad_kubelet_settings_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        build_config({"kubelet": section})
