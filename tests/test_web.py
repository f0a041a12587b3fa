import base64

import bcrypt
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import ConfigError
from exporter.exposition import build_registry
from exporter.web import BasicAuth, HttpServer, load_web_config, make_app

from conftest import make_state


@pytest.fixture
def serve(clock):
    servers = []

    def start(state, web=None, auth=None, stale_after=15.0):
        holder = {"state": state}
        registry = build_registry(lambda: holder["state"], clock.now)
        app = make_app(registry, lambda: holder["state"], clock.now, stale_after, auth=auth)
        server = HttpServer(app, "127.0.0.1", 0, web).start()
        servers.append(server)
        scheme = "https" if server.tls else "http"
        return f"{scheme}://127.0.0.1:{server.port}", holder

    yield start
    for s in servers:
        s.stop()


def samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_endpoint_serves_the_state(serve):
    url, _ = serve(make_state())
    r = requests.get(url + "/metrics", timeout=5)
    assert r.status_code == 200
    got = samples(r.text)
    assert got[("gpumem_gpu_memory_used_bytes", (("gpu", "0"), ("uuid", "GPU-aaaa")))] == 40 * (1 << 30)
    assert got[("gpumem_exporter_errors_total", (("kind", "timeout"), ("source", "nvml")))] == 2
    assert ("process_resident_memory_bytes", ()) in got  # the exporter's own footprint


def test_gzip_is_negotiated(serve):
    url, _ = serve(make_state())
    r = requests.get(url + "/metrics", headers={"Accept-Encoding": "gzip"}, timeout=5)
    assert r.headers.get("Content-Encoding") == "gzip"
    assert "gpumem_gpu_info" in r.text


def test_healthz_turns_503_when_the_sample_is_stale(serve, clock):
    url, _ = serve(make_state(t=clock.now()), stale_after=15.0)
    r = requests.get(url + "/healthz", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    clock.advance(16)
    r = requests.get(url + "/healthz", timeout=5)
    assert r.status_code == 503
    assert r.json()["status"] == "stale" and r.json()["sample_age_seconds"] == pytest.approx(16)


def test_healthz_before_any_sample_is_503(serve):
    from exporter.daemon import State
    url, _ = serve(State())
    assert requests.get(url + "/healthz", timeout=5).status_code == 503


def test_admission_follows_the_analysis(serve):
    url, holder = serve(make_state(admission_open=True))
    r = requests.get(url + "/admission", timeout=5)
    assert r.status_code == 200 and r.json()["open"] is True
    holder["state"] = make_state(admission_open=False)
    r = requests.get(url + "/admission", timeout=5)
    assert r.status_code == 503 and r.json()["closed_gpus"] == ["0"]
    assert requests.get(url + "/admission?gpu=7", timeout=5).status_code == 200


def test_findings_api_and_index(serve):
    url, _ = serve(make_state())
    body = requests.get(url + "/api/findings", timeout=5).json()
    assert body["findings"][0]["kind"] == "leak" and body["findings"][0]["pid"] == 101
    assert "/metrics" in requests.get(url + "/", timeout=5).text
    assert requests.get(url + "/nope", timeout=5).status_code == 404
    assert requests.post(url + "/metrics", timeout=5).status_code == 405


HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()


def test_basic_auth(serve):
    url, _ = serve(make_state(), auth=BasicAuth({"prom": HASH}))
    assert requests.get(url + "/metrics", timeout=5).status_code == 401
    assert requests.get(url + "/metrics", auth=("prom", "wrong"), timeout=5).status_code == 401
    assert requests.get(url + "/metrics", auth=("nobody", "s3cret"), timeout=5).status_code == 401
    assert requests.get(url + "/metrics", auth=("prom", "s3cret"), timeout=5).status_code == 200
    # cached path answers the same
    assert requests.get(url + "/healthz", auth=("prom", "s3cret"), timeout=5).status_code == 200


@pytest.mark.parametrize("header", ["Basic !!!notbase64", "Bearer abc", "Basic " + base64.b64encode(b"\xff\xfe").decode(), ""])
def test_malformed_auth_headers_are_refused(header):
    assert BasicAuth({"prom": HASH}).check(header) is False


def test_tls_and_auth_from_web_config(serve, tls_cert, tmp_path):
    cert, key = tls_cert
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                    f"basic_auth_users:\n  prom: '{HASH}'\n")
    web = load_web_config(str(path))
    url, _ = serve(make_state(), web=web, auth=BasicAuth(web.basic_auth_users))
    assert url.startswith("https://")
    r = requests.get(url + "/metrics", auth=("prom", "s3cret"), verify=cert, timeout=5)
    assert r.status_code == 200 and "gpumem_gpu_info" in r.text
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(url.replace("https", "http") + "/metrics", timeout=5)


@pytest.mark.parametrize("text, message", [
    ("basic_auth_users:\n  prom: plaintext\n", "expected a bcrypt hash"),
    ("tls_server_config:\n  cert_file: /x\n", "cert_file and key_file go together"),
    ("tls_server_config:\n  cert_file: /nonexistent\n  key_file: /nonexistent\n", "cannot load certificate"),
    ("tls_server_config:\n  cipher: x\n", "tls_server_config.cipher: unknown"),
    ("tls_config: {}\n", "tls_config: unknown key"),
])
def test_web_config_errors(tmp_path, text, message):
    path = tmp_path / "web.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_web_config(str(path))


def test_metrics_render_once_per_state_not_per_scrape(clock):
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import CollectorRegistry


    class Counting:
        calls = 0

        def collect(self):
            Counting.calls += 1
            yield GaugeMetricFamily("x", "x", value=Counting.calls)

    registry = CollectorRegistry()
    registry.register(Counting())
    holder = {"state": make_state()}
    app = make_app(registry, lambda: holder["state"], clock.now, 15.0)
    server = HttpServer(app, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        first = [requests.get(url, timeout=5).text for _ in range(5)]
        assert len(set(first)) == 1 and Counting.calls == 1  # five scrapes, one render
        holder["state"] = make_state()  # the next tick published a new state
        assert requests.get(url, timeout=5).text != first[0] and Counting.calls == 2
    finally:
        server.stop()
