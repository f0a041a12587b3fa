"""The kubelet pod list client against a real HTTP(S) server on loopback: parsing, the bearer
token, TLS verification, caching (refresh at most every N s, unknown UIDs at most every M s),
and every failure mode answered by keeping the last good list, never by raising."""
from __future__ import annotations

import json
import time

import pytest

from exporter.clock import FixedClock
from exporter.sources.kubelet import KubeletPods, Pod, default_url, in_kubernetes, parse_pod_list
from helpers.clocks import ServerClock
from helpers.kubelet import CID, TOKEN, UID_A, UID_B, Kubelet, pod_item, pod_list


@pytest.fixture
def kubelet():
    k = Kubelet()
    yield k
    k.close()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def client(url, clock, **kw) -> KubeletPods:
    kw.setdefault("timeout_seconds", 2.0)
    return KubeletPods(url, refresh_seconds=60, unknown_refresh_seconds=10, now=clock.now, **kw)


# -- parsing ------------------------------------------------------------------------------------
def test_parse_pod_list_maps_uids_to_names_and_container_ids():
    pods = parse_pod_list(pod_list(pod_item(UID_A, "llama-0", "serving", (("vllm", CID), ("sidecar", "ab" * 32))),
                                   pod_item(UID_B.upper(), "job-1", "batch", ())))
    assert pods[UID_A] == Pod(UID_A, "llama-0", "serving", {CID: "vllm", "ab" * 32: "sidecar"})
    assert pods[UID_B].name == "job-1" and pods[UID_B].namespace == "batch"  # UIDs compared lower-case


def test_parse_pod_list_skips_items_of_the_wrong_shape():
    good = pod_item(UID_A, "llama-0")
    bad = [None, 7, {"metadata": "x"}, {"metadata": {"name": "no-uid"}}, {"metadata": {"uid": UID_B, "name": 5}},
           {"metadata": {"uid": "u", "name": "n"}, "status": {"containerStatuses": [None, {"name": 1}]}}]
    pods = parse_pod_list(pod_list(*bad, good))
    assert set(pods) == {UID_A, "u"}
    assert pods["u"].containers == {}


@pytest.mark.parametrize("data", [[], {"items": "no"}, {"kind": "Status"}, "text", None])
def test_parse_pod_list_rejects_what_is_not_a_pod_list(data):
    from exporter.sources.kubelet import KubeletError
    with pytest.raises(KubeletError) as exc:
        parse_pod_list(data)
    assert exc.value.kind == "parse"


# -- fetching and caching -----------------------------------------------------------------------
def test_lookup_sends_the_token_and_finds_the_pod(kubelet, token_file, clock):
    pods = client(kubelet.url, clock, token_file=token_file)
    pod = pods.lookup(UID_A.upper())
    assert (pod.name, pod.namespace) == ("llama-0", "serving")
    assert pods.container_name(pod, CID[:12]) == "vllm"
    assert pods.container_name(pod, "ffff") == "" and pods.container_name(pod, "") == ""
    assert kubelet.requests == [{"path": "/pods", "authorization": f"Bearer {TOKEN}"}]
    assert pods.up is True and pods.take_errors() == ()


def test_known_pods_are_served_from_the_cache_until_it_is_old(kubelet, clock):
    pods = client(kubelet.url, clock)
    for _ in range(50):
        assert pods.lookup(UID_A).name == "llama-0"
        clock.advance(1)  # 49 s pass: still within refresh_seconds
    assert len(kubelet.requests) == 1
    kubelet.body = json.dumps(pod_list(pod_item(UID_A, "llama-0-renamed"))).encode()
    clock.advance(11)  # 60 s since the fetch
    assert pods.lookup(UID_A).name == "llama-0-renamed"
    assert len(kubelet.requests) == 2


def test_unknown_uid_refreshes_at_most_every_unknown_interval(kubelet, clock):
    pods = client(kubelet.url, clock)
    assert pods.lookup(UID_A) is not None
    assert pods.lookup(UID_B) is None  # just fetched: not again for an unknown UID yet
    assert len(kubelet.requests) == 1
    kubelet.body = json.dumps(pod_list(pod_item(UID_A, "llama-0"), pod_item(UID_B, "new-pod", "batch"))).encode()
    clock.advance(5)
    assert pods.lookup(UID_B) is None and len(kubelet.requests) == 1
    clock.advance(5)  # 10 s since the last fetch: a new pod may have started
    assert pods.lookup(UID_B).name == "new-pod"
    assert len(kubelet.requests) == 2
    for _ in range(21):  # a UID the kubelet never knows does not hammer it
        pods.lookup("ffffffff-ffff-ffff-ffff-ffffffffffff")
        clock.advance(1)
    assert len(kubelet.requests) == 4  # at 10 s and 20 s after the second fetch, not every second


def test_empty_uid_never_fetches(kubelet, clock):
    pods = client(kubelet.url, clock)
    assert pods.lookup("") is None
    assert kubelet.requests == [] and pods.up is None


# -- failures: recorded, the last good list kept, never raised ----------------------------------
def fail_then_check(kubelet, pods, clock, kind):
    assert pods.lookup(UID_A).name == "llama-0"
    clock.advance(60)
    assert pods.lookup(UID_A).name == "llama-0", "a failed refresh keeps the last good list"
    assert pods.up is False
    errors = pods.take_errors()
    assert [(e.source, e.kind) for e in errors] == [("kubelet", kind)]
    assert pods.take_errors() == ()
    return errors


@pytest.mark.parametrize("status", [401, 403, 500])
def test_http_error_status(kubelet, clock, status, token_file):
    pods = client(kubelet.url, clock, token_file=token_file)
    pods.lookup(UID_A)
    kubelet.status = status
    errors = fail_then_check(kubelet, pods, clock, "http_status")
    assert str(status) in errors[0].message and TOKEN not in errors[0].message


@pytest.mark.parametrize("body, kind", [(b"<html>not json", "parse"), (b'{"items": 3}', "parse"),
                                        (b"\xff\xfe\x00", "parse")])
def test_garbage_answer(kubelet, clock, body, kind):
    pods = client(kubelet.url, clock)
    pods.lookup(UID_A)
    kubelet.body = body
    fail_then_check(kubelet, pods, clock, kind)


def test_answer_larger_than_the_bound(kubelet, clock):
    pods = KubeletPods(kubelet.url, max_response_bytes=4096, now=clock.now)
    pods.lookup(UID_A)
    kubelet.body = json.dumps(pod_list(*[pod_item(UID_A, f"p{i}") for i in range(100)])).encode()
    assert len(kubelet.body) > 4096
    fail_then_check(kubelet, pods, clock, "too_large")


def test_slow_drip_hits_the_total_deadline(kubelet):
    clock = ServerClock(1_000_000.0)  # the deadline and the drip on one clock, not the machine's speed
    # The first fetch, before the clock is the server's, has 10 real seconds: time enough on a
    # loaded machine. Then 0.3 s on the server's clock, whose every chunk moves it 0.05 s.
    pods = client(kubelet.url, clock, timeout_seconds=10)
    pods.lookup(UID_A)
    pods.timeout_seconds = 0.3
    kubelet.delay_per_chunk = 0.05  # each read returns in time; the whole answer does not
    kubelet.clock = clock
    started = clock.now()
    fail_then_check(kubelet, pods, clock, "timeout")
    # less the 60 s fail_then_check moves the clock by to make the list due for a refresh
    assert clock.now() - started - 60 < 2.0


def test_a_redirect_is_an_error_and_its_body_is_never_read(kubelet, clock):
    pods = client(kubelet.url, clock)
    pods.lookup(UID_A)
    kubelet.redirect_body_mib = 400
    errors = fail_then_check(kubelet, pods, clock, "http_status")
    assert "302" in errors[0].message and "not followed" in errors[0].message
    deadline = time.monotonic() + 30  # the server notices the hang-up on its next write
    while not kubelet.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kubelet.sent[0] < 64 << 20, "only what fits in socket buffers left the server"


def test_nothing_listening(clock):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        pods = client(f"http://127.0.0.1:{port}/pods", clock)
        assert pods.lookup(UID_A) is None
    assert [e.kind for e in pods.take_errors()] == ["refused"]


def test_unreadable_token_is_an_error_that_names_the_file_not_the_token(kubelet, clock, tmp_path):
    pods = client(kubelet.url, clock, token_file=str(tmp_path / "missing"))
    assert pods.lookup(UID_A) is None
    [error] = pods.take_errors()
    assert error.kind == "token_unreadable" and "missing" in error.message
    assert kubelet.requests == []  # nothing was sent without the token


def test_token_is_reread_on_each_fetch(kubelet, clock, token_file):
    pods = client(kubelet.url, clock, token_file=token_file)
    pods.lookup(UID_A)
    with open(token_file, "w") as fh:
        fh.write("rotated-token")
    clock.advance(60)
    pods.lookup(UID_A)
    assert [r["authorization"] for r in kubelet.requests] == [f"Bearer {TOKEN}", "Bearer rotated-token"]


def test_errors_waiting_to_be_collected_are_bounded(clock):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        pods = client(f"http://127.0.0.1:{s.getsockname()[1]}/pods", clock)
        for _ in range(150):
            pods.lookup(UID_A)
            clock.advance(10)
    errors = pods.take_errors()
    assert len(errors) == 101 and errors[-1].kind == "errors_dropped" and errors[-1].message == "50 more"


# -- TLS ----------------------------------------------------------------------------------------
@pytest.fixture
def tls_kubelet(tls_cert):
    k = Kubelet(tls=tls_cert)
    yield k
    k.close()


@pytest.mark.integration
def test_https_verified_against_the_given_ca(tls_kubelet, tls_cert, clock, token_file):
    pods = client(tls_kubelet.url, clock, token_file=token_file, ca_file=tls_cert[0])
    assert pods.lookup(UID_A).name == "llama-0"
    assert tls_kubelet.requests[0]["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.integration
def test_https_with_an_untrusted_certificate_is_refused_before_the_token_is_sent(tls_kubelet, clock, token_file):
    pods = client(tls_kubelet.url, clock, token_file=token_file)  # system CAs do not know this cert
    assert pods.lookup(UID_A) is None
    assert [e.kind for e in pods.take_errors()] == ["tls"]
    assert tls_kubelet.requests == []


@pytest.mark.integration
def test_https_insecure_skip_verify(tls_kubelet, clock):
    pods = client(tls_kubelet.url, clock, insecure_skip_verify=True)
    assert pods.lookup(UID_A).name == "llama-0"


# -- where it is enabled ------------------------------------------------------------------------
def test_default_url_from_the_downward_api():
    assert default_url({}) == ""
    assert default_url({"NODE_NAME": "gpu-node-1"}) == "https://gpu-node-1:10250/pods"
    assert default_url({"NODE_NAME": "gpu-node-1", "NODE_IP": "10.0.0.7"}) == "https://10.0.0.7:10250/pods"
    assert default_url({"NODE_IP": "fd00::7"}) == "https://[fd00::7]:10250/pods"


def test_in_kubernetes_needs_the_service_host_and_the_token_file(token_file, tmp_path):
    assert in_kubernetes(token_file, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert not in_kubernetes(token_file, {})
    assert not in_kubernetes(str(tmp_path / "none"), {"KUBERNETES_SERVICE_HOST": "10.96.0.1"})


@pytest.fixture
def clock():
    return FixedClock(1_000_000.0)
