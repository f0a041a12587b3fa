import base64
import re
import socket

import bcrypt
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import ConfigError
from exporter.model import Finding
from exporter.serve import web
from exporter.serve.auth import BasicAuth
from exporter.serve.exposition import build_registry
from exporter.serve.server import HttpServer
from exporter.serve.web import make_app
from exporter.serve.webconfig import load_web_config
from helpers.state import make_state
from helpers.tools import HANG


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
    r = requests.get(url + "/metrics", timeout=HANG)
    assert r.status_code == 200
    got = samples(r.text)
    assert got[("gpumem_gpu_memory_used_bytes", (("gpu", "0"), ("uuid", "GPU-aaaa")))] == 40 * (1 << 30)
    assert got[("gpumem_exporter_errors_total", (("kind", "timeout"), ("source", "nvml")))] == 2
    assert ("process_resident_memory_bytes", ()) in got  # the exporter's own footprint


def test_gzip_is_negotiated(serve):
    url, _ = serve(make_state())
    r = requests.get(url + "/metrics", headers={"Accept-Encoding": "gzip"}, timeout=HANG)
    assert r.headers.get("Content-Encoding") == "gzip"
    assert "gpumem_gpu_info" in r.text


def test_healthz_turns_503_when_the_sample_is_stale(serve, clock):
    url, _ = serve(make_state(t=clock.now()), stale_after=15.0)
    r = requests.get(url + "/healthz", timeout=HANG)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    clock.advance(16)
    r = requests.get(url + "/healthz", timeout=HANG)
    assert r.status_code == 503
    assert r.json()["status"] == "stale" and r.json()["sample_age_seconds"] == pytest.approx(16)


def test_healthz_before_any_sample_is_503(serve):
    from exporter.model import State
    url, _ = serve(State())
    assert requests.get(url + "/healthz", timeout=HANG).status_code == 503


def test_admission_follows_the_analysis(serve):
    url, holder = serve(make_state(admission_open=True))
    r = requests.get(url + "/admission", timeout=HANG)
    assert r.status_code == 200 and r.json()["open"] is True
    holder["state"] = make_state(admission_open=False)
    r = requests.get(url + "/admission", timeout=HANG)
    assert r.status_code == 503 and r.json()["closed_gpus"] == ["0"]
    assert requests.get(url + "/admission?gpu=0", timeout=HANG).status_code == 503
    # issue 14: no such GPU is a bad argument (it was 200 "known": false, which hid typos)
    r = requests.get(url + "/admission?gpu=7", timeout=HANG)
    assert r.status_code == 400 and r.json() == {"error": "no such GPU: 7", "gpus": ["0"]}


def test_admission_before_the_first_analysis_is_open_and_unknown_for_any_gpu(serve):
    from exporter.model import State
    url, _ = serve(State())
    for query in ("", "?gpu=0", "?gpu=99"):
        r = requests.get(url + "/admission" + query, timeout=HANG)
        assert r.status_code == 200 and r.json()["known"] is False and r.json()["open"] is True


def test_findings_api_and_index(serve):
    url, _ = serve(make_state())
    body = requests.get(url + "/api/findings", timeout=HANG).json()
    assert body["findings"][0]["kind"] == "leak" and body["findings"][0]["pid"] == 101
    assert "/metrics" in requests.get(url + "/", timeout=HANG).text
    assert requests.get(url + "/nope", timeout=HANG).status_code == 404
    assert requests.post(url + "/metrics", timeout=HANG).status_code == 405


HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()


def test_basic_auth(serve):
    url, _ = serve(make_state(), auth=BasicAuth({"prom": HASH}))
    assert requests.get(url + "/metrics", timeout=HANG).status_code == 401
    assert requests.get(url + "/metrics", auth=("prom", "wrong"), timeout=HANG).status_code == 401
    assert requests.get(url + "/metrics", auth=("nobody", "s3cret"), timeout=HANG).status_code == 401
    assert requests.get(url + "/metrics", auth=("prom", "s3cret"), timeout=HANG).status_code == 200
    # cached path answers the same
    assert requests.get(url + "/healthz", auth=("prom", "s3cret"), timeout=HANG).status_code == 200


@pytest.mark.parametrize("header", ["Basic !!!notbase64", "Bearer abc",
                                    "Basic " + base64.b64encode(b"\xff\xfe").decode(), ""])
def test_malformed_auth_headers_are_refused(header):
    assert BasicAuth({"prom": HASH}).check(header) is False


@pytest.mark.integration
def test_tls_and_auth_from_web_config(serve, tls_cert, tmp_path):
    cert, key = tls_cert
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                    f"basic_auth_users:\n  prom: '{HASH}'\n")
    web = load_web_config(str(path))
    url, _ = serve(make_state(), web=web, auth=BasicAuth(web.basic_auth_users))
    assert url.startswith("https://")
    r = requests.get(url + "/metrics", auth=("prom", "s3cret"), verify=cert, timeout=HANG)
    assert r.status_code == 200 and "gpumem_gpu_info" in r.text
    # Plain HTTP on the TLS port: told so, and served nothing, credentials or not.
    plain = requests.get(url.replace("https", "http") + "/metrics", auth=("prom", "s3cret"), timeout=HANG)
    assert plain.status_code == 400 and "gpumem" not in plain.text and "HTTPS server" in plain.text


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


def test_metrics_render_once_per_state_not_per_scrape(clock, monkeypatch):
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
    # A rendering is reused for a second of real time at most: the scrapes below, on a loaded
    # machine, may take longer than that.
    monkeypatch.setattr(web.MetricsCache, "max_age", HANG)
    app = make_app(registry, lambda: holder["state"], clock.now, 15.0)
    server = HttpServer(app, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        first = [requests.get(url, timeout=HANG).text for _ in range(5)]
        assert len(set(first)) == 1 and Counting.calls == 1  # five scrapes, one render
        holder["state"] = make_state()  # the next tick published a new state
        assert requests.get(url, timeout=HANG).text != first[0] and Counting.calls == 2
    finally:
        server.stop()


def test_query_strings_other_than_name_share_one_rendering(clock, monkeypatch):
    """issue 14: a unique query string per scrape (a cache-buster) must not cost a rendering."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import CollectorRegistry

    class Counting:
        calls = 0

        def collect(self):
            Counting.calls += 1
            yield GaugeMetricFamily("x", "x", value=1)
            yield GaugeMetricFamily("y", "y", value=2)

    registry = CollectorRegistry(auto_describe=True)  # name[] needs to know which collector has which name
    registry.register(Counting())
    Counting.calls = 0
    # A rendering is reused for a second of real time at most: the scrapes below, on a loaded
    # machine, may take longer than that.
    monkeypatch.setattr(web.MetricsCache, "max_age", HANG)
    state = make_state()
    server = HttpServer(make_app(registry, lambda: state, clock.now, 15.0), "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        for i in range(5):
            assert "x 1.0" in requests.get(f"{url}?nocache={i}", timeout=HANG).text
        assert Counting.calls == 1
        only_y = requests.get(f"{url}?name[]=y&nocache=1", timeout=HANG).text
        assert "y 2.0" in only_y and "x 1.0" not in only_y and Counting.calls == 2
        requests.get(f"{url}?nocache=2&name[]=y", timeout=HANG)
        assert Counting.calls == 2  # the same name[] list, another cache-buster
    finally:
        server.stop()


def test_head_answers_headers_without_a_body(serve):
    url, _ = serve(make_state())
    port = int(url.rsplit(":", 1)[1])
    for path in ("/metrics", "/healthz", "/"):
        with socket.create_connection(("127.0.0.1", port), timeout=HANG) as s:
            s.sendall(f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200 ") and body == b"", path
        length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
        if path == "/metrics":  # the exporter's own process metrics change between renderings
            assert length > 1000
        else:
            assert length == len(requests.get(url + path, timeout=HANG).content)  # the GET answer's length


def hostile_state():
    """make_state with text from the host that would be markup: a process name from /proc, a
    GPU name, a finding's summary, an endpoint's error."""
    import dataclasses
    state = make_state()
    evil = "<script>alert(1)</script>"
    snap = state.snapshot
    gpu = dataclasses.replace(snap.gpus[0], name=evil,
                              processes=tuple(dataclasses.replace(p, name=evil) for p in snap.gpus[0].processes))
    vllm = tuple(dataclasses.replace(v, endpoint=evil, error_kind=evil) for v in snap.vllm)
    finding = dataclasses.replace(state.analysis.findings[0], process=evil, summary=f"grows {evil}")
    return dataclasses.replace(state, snapshot=dataclasses.replace(snap, gpus=(gpu,), vllm=vllm),
                               analysis=dataclasses.replace(state.analysis, findings=(finding,)))


def test_status_page_tells_what_a_newcomer_wants_to_know(clock):
    state = make_state(t=clock.now() - 2)
    server = HttpServer(make_app(build_registry(lambda: state, clock.now), lambda: state, clock.now, 15.0,
                                 host=lambda: "simulated: scenario fleet-8x64"), "127.0.0.1", 0).start()
    try:
        r = requests.get(f"http://127.0.0.1:{server.port}/", timeout=HANG)
    finally:
        server.stop()
    assert r.status_code == 200 and r.headers["Content-Type"] == "text/html; charset=utf-8"
    page = r.text
    assert "simulated: scenario fleet-8x64" in page and "2.0 s ago" in page
    # the GPU with its use and headroom, and its admission
    assert "NVIDIA H100 80GB HBM3" in page and "40.00 GiB of 80.00 GiB (50%)" in page
    assert "<td>40.00 GiB</td><td>open</td>" in page  # free bytes, then admission
    # the active finding with its summary, and every source up or down
    assert "<td>leak</td>" in page and "<td>101 proc101</td><td>grows 4 MiB/min</td>" in page
    assert "<th>what to change</th>" in page and "<td>check NCCL_CUMEM_ENABLE</td>" in page  # its advice
    assert "<td>nvml</td>" in page and "<td>vllm down</td><td><span class=\"bad\">down</span> refused" in page
    # each vLLM server's budget, KV cache use and queue, in one table (#19: there were two)
    assert page.count("<h2>vLLM servers</h2>") == 1
    assert ("<td>llama</td><td>meta-llama/Llama-3.1-8B</td><td><span class=\"ok\">up</span> loading</td>"
            "<td>GPU 0: 1.00 GiB of 72.00 GiB</td><td>42%</td><td>3</td><td>1</td><td>5</td>") in page
    for link in ("metrics", "healthz", "admission", "api/findings"):
        assert f'<a href="{link}">' in page
    assert "<script" not in page  # no script needed
    assert '<meta http-equiv="refresh" content="10">' in page and "reloads every 10 s" in page


def played(scenario, until, step=30.0):
    """The State a daemon would publish after playing `scenario` up to `until` seconds."""
    from exporter.cli import make_analyzer
    from exporter.config import build as build_config
    from exporter.model import State
    from exporter.runtime import build as build_runtime
    config = build_config()
    runtime = build_runtime(config, simulate=scenario, at=0.0)
    analyzer = make_analyzer(config)
    try:
        while True:
            snap = runtime.sampler.sample()
            analysis = analyzer.update(snap)
            if runtime.clock.elapsed() >= until:
                return State(snapshot=snap, analysis=analysis, samples_total=1, last_sample_at=snap.timestamp)
            runtime.clock.advance(step)
    finally:
        runtime.close()


def test_status_page_shows_each_vllm_budget_and_kv_use_and_why_a_full_gpu_is_fine():
    """86 % used and no finding: the page says why (vLLM takes its budget up front), and shows
    each server's budget, KV cache use and requests (#19 item 6)."""
    from exporter.serve import status
    page = status.render(played("steady", 900), "simulated: scenario steady", 1.0, 15.0)
    assert "<h2>vLLM servers</h2>" in page
    row = page[page.index("<h2>vLLM servers</h2>"):page.index("<h2>Findings</h2>")]
    assert "Qwen/Qwen2.5-32B-Instruct" in row
    assert re.search(r"GPU 0: 6\d\.\d\d GiB of 71\.22 GiB; GPU 1: 6\d\.\d\d GiB of 71\.22 GiB "
                     r"\(gpu_memory_utilization 0\.9\)", row)
    assert re.search(r"<td>\d+% \([\d,]+ of 299,008 tokens\), 36\.50 GiB per GPU</td><td>\d+</td><td>\d+</td>"
                     r"<td>0</td>", row)
    assert "<th>running</th><th>waiting</th><th>preempted (total)</th>" in row
    gpus = page[page.index("<h2>GPUs</h2>"):page.index("<h2>vLLM servers</h2>")]
    assert gpus.count("no finding: 86% used; ") == 2 and "inside its budget of 71.22 GiB" in gpus


def test_status_page_says_a_vllm_server_is_still_loading():
    """`steady` starts with its server loading: the GPUs at a few % while vLLM is up is not a
    mystery on the page (#19 item 6)."""
    from exporter.serve import status
    page = status.render(played("steady", 30, step=10), "simulated: scenario steady", 1.0, 15.0)
    gpus = page[page.index("<h2>GPUs</h2>"):page.index("<h2>vLLM servers</h2>")]
    assert gpus.count("loading: vLLM sim-0 holds ") == 2 and "of its 71.22 GiB budget so far" in gpus
    assert '<span class="ok">up</span> loading' in page
    page = status.render(played("steady", 300), "simulated: scenario steady", 1.0, 15.0)
    assert "loading" not in page


def test_status_page_names_the_findings_that_put_a_gpu_in_trouble_and_a_gpu_down():
    from exporter.serve import status
    page = status.render(played("contention", 2400), "simulated: scenario contention", 1.0, 15.0)
    gpus = page[page.index("<h2>GPUs</h2>"):page.index("<h2>vLLM servers</h2>")]
    assert '<span class="bad">contention (warning), pressure (warning)</span>: see Findings' in gpus
    page = status.render(played("gpu-lost", 900, step=60), "simulated: scenario gpu-lost", 1.0, 15.0)
    assert '<td>nvml</td><td><span class="ok">up</span> <span class="bad">GPU 1 down: gpu_is_lost</span>' in page
    assert "gpu_unavailable (critical)" in page


def _section(page: str, title: str) -> str:
    start = page.index(f"<h2>{title}</h2>")
    return page[start:page.index("<h2>", start + 1)]


def test_a_gpu_row_names_the_findings_of_the_servers_on_it():
    """kv_saturation has no GPU of its own: the GPUs its server runs on are in trouble with it,
    not "no finding: 86% used" (the trial's kv-saturation)."""
    import dataclasses

    from exporter.serve import status
    state = make_state()
    snap = state.snapshot
    served = dataclasses.replace(snap.gpus[0], processes=tuple(
        dataclasses.replace(p, endpoint="llama") if p.role == "vllm" else p for p in snap.gpus[0].processes))
    saturated = Finding(kind="kv_saturation", severity="warning", first_detected_at=snap.timestamp,
                        endpoint="llama", summary="KV cache full")
    state = dataclasses.replace(state, snapshot=dataclasses.replace(snap, gpus=(served,)),
                                analysis=dataclasses.replace(state.analysis, findings=(saturated,)))
    gpus = _section(status.render(state, "real", 1.0, 15.0), "GPUs")
    assert "kv_saturation (warning) of vLLM llama, which runs here</span>: see Findings" in gpus
    assert "no finding" not in gpus


def test_a_lost_gpu_closes_and_names_its_tensor_parallel_peer_on_the_page():
    from exporter.serve import status
    page = status.render(played("gpu-lost", 900, step=60), "simulated: scenario gpu-lost", 1.0, 15.0)
    row0 = _section(page, "GPUs").split("<tr>")[2]
    assert row0.startswith("<td>0</td>")
    assert '<span class="bad">closed</span> (vLLM sim-0 also spans GPU 1, which does not answer)' in row0
    assert "gpu_unavailable (critical) on GPU 1 of vLLM sim-0, which runs here" in row0
    assert "no finding" not in row0
    findings = _section(page, "Findings")
    assert "vLLM sim-0 (also on GPU 0, closed to new work too) ran on it" in findings
    assert "nvidia-smi -r -i 1" in findings and "-i N" not in findings


def test_the_findings_table_shows_the_processes_a_finding_names():
    """Contention and pressure name pid 5230 in their text: the process column says so too."""
    from exporter.serve import status
    findings = _section(status.render(played("contention", 2400), "simulated: scenario contention", 1.0, 15.0),
                        "Findings")
    rows = {re.search(r"<td>(contention|pressure)</td>", r).group(1): r
            for r in findings.split("<tr>") if re.search(r"<td>(contention|pressure)</td>", r)}
    assert "<td>5230 python3 (started by jupyter-notebook)</td>" in rows["contention"]
    # The engine's name says what it is: no parent.
    assert re.search(r"<td>5150 VLLM::EngineCore; 5230 python3 \(started by jupyter-notebook\)[^<]*</td>",
                     rows["pressure"])


def test_the_last_oom_stays_on_the_page_after_its_finding_is_held():
    """The oom finding holds 5 minutes; then the GPU row says when the last OOM was and of what
    class, and a table lists the day's out-of-memory findings."""
    from exporter.serve import status
    page = status.render(played("oom", 2400, step=60), "simulated: scenario oom", 1.0, 15.0)
    gpus = _section(page, "GPUs")
    assert "oom (critical)" not in gpus
    assert re.search(r"no finding: [^<]*; last out-of-memory \d+ min ago \(shortage\): see Recent out-of-memory", gpus)
    recent = _section(page, "Recent out-of-memory")
    assert "<th>when</th><th>GPU</th><th>class</th>" in recent and re.search(r"cleared \d+ min ago", recent)
    assert re.search(r"\d+ out-of-memory events? in the logs", recent)


def test_a_missing_gpu_library_is_said_not_no_gpu_sampled_yet():
    """A real host without the NVML library: after several samples the page said "No GPU sampled
    yet."; it says the GPU library is unavailable and why."""
    from exporter.model import Snapshot, SourceStatus, State
    from exporter.serve import status
    snap = Snapshot(timestamp=1000.0, sources=(SourceStatus("nvml", False, 0.001, "library_not_found"),
                                               SourceStatus("host", True, 0.001)))
    page = status.render(State(snapshot=snap, samples_total=6, last_sample_at=1000.0), "real", 1.0, 15.0)
    gpus = _section(page, "GPUs")
    assert "No GPU sampled yet." not in gpus
    assert ("No GPU could be read in 6 samples: the GPU library (NVML, gpu.backend nvml) is unavailable "
            "(library_not_found).") in gpus


def test_status_page_escapes_text_from_the_host(clock):
    from exporter.serve import status
    page = status.render(hostile_state(), "simulated: scenario <b>x</b>", 1.0, 15.0)
    assert "<script>" not in page and "<b>x</b>" not in page
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 4  # GPU, finding, endpoint, error
    assert "grows &lt;script&gt;" in page and "&lt;b&gt;x&lt;/b&gt;" in page


def test_status_page_before_the_first_sample(clock):
    from exporter.model import State
    from exporter.serve import status
    page = status.render(State(), "real", None, 15.0)
    assert "no sample yet" in page and "No GPU sampled yet." in page and "No active findings." in page
    assert "No vLLM endpoint configured." in page


def test_health_paths_alone_are_served_without_auth(clock):
    """The health listener (`health_listen`): what probes need, no auth, nothing else."""
    from exporter.serve.web import HEALTH_PATHS
    state = make_state(t=clock.now())
    app = make_app(build_registry(lambda: state, clock.now), lambda: state, clock.now, 15.0, paths=HEALTH_PATHS)
    server = HttpServer(app, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        assert requests.get(url + "/healthz", timeout=HANG).status_code == 200
        assert requests.get(url + "/admission", timeout=HANG).json()["open"] is True
        for path in ("/metrics", "/", "/api/findings"):
            r = requests.get(url + path, timeout=HANG)
            assert r.status_code == 404 and "gpumem" not in r.text and "leak" not in r.text
    finally:
        server.stop()


@pytest.mark.parametrize("request_line", [b"GET /healthz HTTP/1.1", b"GET / HTTP/9.9"])
def test_the_server_header_names_no_python_version(serve, request_line):
    # Answers from the app and errors sent before it runs (a bad version) alike.
    url, _ = serve(make_state())
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=HANG) as sock:
        sock.sendall(request_line + b"\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    headers = answer.split(b"\r\n\r\n", 1)[0].decode()
    assert "\r\nServer: gpu-memory-exporter\r\n" in headers
    assert "Python" not in headers


def test_a_simulated_host_says_where_its_scenario_clock_stands():
    from exporter.config import build as build_config
    from exporter.runtime import build as build_runtime
    runtime = build_runtime(build_config(), simulate="contention", at=0.0)
    try:
        assert runtime.host.sampled() == "simulated: scenario contention, at 0h00m of 3h00m"
        runtime.clock.advance(35 * 60 + 20)
        assert runtime.host.sampled() == "simulated: scenario contention, at 0h35m of 3h00m"
        runtime.clock.advance(3 * 3600)
        assert runtime.host.sampled() == ("simulated: scenario contention, at 3h35m, "
                                          "past the end of its story (3h00m)")
    finally:
        runtime.close()
