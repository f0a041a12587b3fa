"""The Grafana dashboards: generated from grafana/generate.py, valid JSON, every query valid PromQL
(checked by the real promtool) over metric names that exist, every variable defined."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from alerts.rules import ALERT_GROUPS
from exporter.thresholds import MEMORY_HIGH, MEMORY_NEAR_FULL, VLLM_BUDGET_SLACK
from helpers.dashboards import (
    BUILTINS,
    DASHBOARD_FILES,
    GRAFANA,
    PROBE_SERIES,
    VARIABLE,
    all_panels,
    load,
    queries,
    substitute,
    variable_queries,
)
from helpers.dashboards import label_values_selector as _label_values_selector
from helpers.rules import DECLARED_METRICS, PROMETHEUS_METRICS, RULES, metric_names, recording_rules
from helpers.scenarios import STEP, played, promtool_series
from helpers.tools import HANG, REPO, free_port, tool

COMPOSE = REPO / "deploy" / "compose" / "docker-compose.yml"


def known_metrics() -> frozenset[str]:
    return DECLARED_METRICS | PROMETHEUS_METRICS | {r["record"] for r in recording_rules()}


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_five_dashboards_exist():
    assert [p.name for p in DASHBOARD_FILES] == [
        "fleet.json", "leak-investigation.json", "memory-budget.json", "overview.json", "vllm.json"]


def test_dashboards_are_what_the_generator_writes(generator):
    rendered = generator.render()
    assert sorted(rendered) == [p.name for p in DASHBOARD_FILES]
    stale = [name for name, text in rendered.items() if (GRAFANA / "dashboards" / name).read_text() != text]
    assert stale == [], f"run `python grafana/generate.py`: {stale} differ from the generator"


def test_uids_and_titles_are_unique():
    dashboards = [load(p) for p in DASHBOARD_FILES]
    assert len({d["uid"] for d in dashboards}) == len(dashboards)
    assert len({d["title"] for d in dashboards}) == len(dashboards)


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_panels_have_unique_ids_and_fit_the_grid(path):
    panels = all_panels(load(path))
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_query_uses_known_metrics(path):
    dashboard = load(path)
    exprs = queries(dashboard) + [("variable", q) for q in variable_queries(dashboard)]
    assert exprs
    unknown = {where: sorted(metric_names(substitute(_label_values_selector(e))) - known_metrics())
               for where, e in exprs}
    assert {w: u for w, u in unknown.items() if u} == {}


@pytest.mark.integration
def test_every_query_is_valid_promql(tmp_path):
    """promtool parses each expression (variables substituted) as a recording rule."""
    rules = []
    for path in DASHBOARD_FILES:
        dashboard = load(path)
        exprs = [e for _, e in queries(dashboard)] + [_label_values_selector(q) for q in variable_queries(dashboard)]
        rules += [{"record": f"dashboard:{path.stem.replace('-', '_')}:expr{i}", "expr": substitute(e)}
                  for i, e in enumerate(exprs)]
    rule_file = tmp_path / "dashboards.rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([tool("promtool"), "check", "rules", str(rule_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


@pytest.mark.integration
def test_promtool_rejects_a_broken_expression(tmp_path):
    """The check above can fail: an unbalanced expression is an error."""
    rule_file = tmp_path / "broken.rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x:y", "expr": substitute('sum(gpumem_gpu_memory_used_bytes{gpu=~"$gpu"}')}]}]}))
    result = subprocess.run([tool("promtool"), "check", "rules", str(rule_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_variable_used_is_defined(path):
    dashboard = load(path)
    defined = {v["name"] for v in dashboard["templating"]["list"]} | set(BUILTINS)
    text = [e for _, e in queries(dashboard)] + variable_queries(dashboard)
    text += [p["title"] for p in all_panels(dashboard)] + [p["repeat"] for p in all_panels(dashboard) if "repeat" in p]
    used = {m.group(1) or m.group(2) for t in text for m in VARIABLE.finditer(t)}
    used |= {p["repeat"] for p in all_panels(dashboard) if "repeat" in p}
    assert used - defined == set()


@pytest.mark.parametrize("path, needed", [
    ("overview.json", {"datasource", "instance", "gpu"}),
    ("memory-budget.json", {"datasource", "instance", "gpu", "process"}),
    ("leak-investigation.json", {"datasource", "instance", "gpu", "process"}),
    ("vllm.json", {"datasource", "instance", "gpu", "endpoint"}),
    ("fleet.json", {"datasource", "instance", "namespace", "pod"}),
])
def test_dashboards_have_their_template_variables(path, needed):
    variables = {v["name"]: v for v in load(GRAFANA / "dashboards" / path)["templating"]["list"]}
    assert needed <= set(variables)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_panel_and_query_uses_the_datasource_variable(path):
    for p in all_panels(load(path)):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


def test_leak_dashboard_marks_leak_findings_as_annotations():
    annotations = load(GRAFANA / "dashboards" / "leak-investigation.json")["annotations"]["list"]
    assert any("gpumem_leak_suspected" in a.get("expr", "") and a["enable"] for a in annotations)


def test_memory_budget_stacks_every_part_of_the_gpu():
    dashboard = load(GRAFANA / "dashboards" / "memory-budget.json")
    stack = next(p for p in all_panels(dashboard) if p.get("repeat") == "gpu")
    exprs = " ".join(t["expr"] for t in stack["targets"])
    for part in ('component=~"weights"', 'component=~"kv_cache"', "activation_peak",
                 "instance_gpu:gpumem_other_process_memory:bytes", "gpumem_gpu_memory_free_bytes",
                 "instance_gpu:gpumem_vllm_memory_budget:bytes"):
        assert part in exprs
    assert stack["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def test_provisioning_points_at_the_dashboards_compose_mounts():
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "gpu-memory-exporter.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["../../grafana/dashboards"] == path
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    assert RULES.exists()


# -- a real Prometheus answers every dashboard query --------------------------------------------
# One host as the exporter would show it: GPU 0 serves vLLM (budget, profile) beside another
# process; GPU 1 is idle. Prometheus scrapes this page, evaluates the rules, and every panel,
# annotation and variable query must then return data (a join with the wrong cardinality or a
# label that does not exist returns an error or nothing, which parsing alone cannot see).
# Counters grow with every scrape (TICK is the scrape's number) so that rates are not zero.
# The vLLM process runs the allocator probe (the python process does not): its 72 GiB are 70 GiB
# reserved by PyTorch plus 2 GiB outside it, and its live tensors (ALLOCATED) grow by 1 MiB a
# scrape into the cache, so torch allocated rises, cached-but-free falls, non-torch stays flat.
EXPOSITION = """\
gpumem_gpu_info{gpu="0",uuid="GPU-0",name="NVIDIA H100",unified="false",mig="false"} 1
gpumem_gpu_info{gpu="1",uuid="GPU-1",name="NVIDIA H100",unified="false",mig="false"} 1
gpumem_gpu_up{gpu="0",uuid="GPU-0"} 1
gpumem_gpu_up{gpu="1",uuid="GPU-1"} 1
gpumem_gpu_memory_total_bytes{gpu="0",uuid="GPU-0"} 85899345920
gpumem_gpu_memory_total_bytes{gpu="1",uuid="GPU-1"} 85899345920
gpumem_gpu_memory_used_bytes{gpu="0",uuid="GPU-0"} 81604378624
gpumem_gpu_memory_used_bytes{gpu="1",uuid="GPU-1"} 536870912
gpumem_gpu_memory_free_bytes{gpu="0",uuid="GPU-0"} 4294967296
gpumem_gpu_memory_free_bytes{gpu="1",uuid="GPU-1"} 85362475008
gpumem_gpu_memory_unattributed_bytes{gpu="0",uuid="GPU-0"} 0
gpumem_gpu_memory_unattributed_bytes{gpu="1",uuid="GPU-1"} 536870912
gpumem_gpu_memory_beyond_budget_bytes{gpu="0",uuid="GPU-0"} 4294967296
gpumem_gpu_memory_beyond_budget_bytes{gpu="1",uuid="GPU-1"} 536870912
gpumem_gpu_time_to_full_seconds{gpu="0",uuid="GPU-0"} 7200
gpumem_process_memory_used_bytes{gpu="0",uuid="GPU-0",pid="1000",process="vllm",role="vllm",container="3f4e3f4e3f4e",pod="llama-0",namespace="inference"} 77309411328
gpumem_process_memory_used_bytes{gpu="0",uuid="GPU-0",pid="4242",process="python",role="other"} 4294967296
gpumem_process_host_rss_bytes{pid="1000",process="vllm",role="vllm",container="3f4e3f4e3f4e",pod="llama-0",namespace="inference"} 8589934592
gpumem_process_host_rss_bytes{pid="4242",process="python",role="other"} 1073741824
gpumem_process_memory_growth_bytes_per_second{gpu="0",pid="4242",process="python",role="other"} 10240
gpumem_leak_suspected{gpu="0",pid="4242",process="python",role="other"} 1
gpumem_leak_suspected{gpu="0",pid="1000",process="vllm",role="vllm"} 0
gpumem_finding_active{kind="leak",severity="warning",gpu="0",pid="4242",process="python",role="other"} 1
gpumem_admission_open{gpu="0"} 0
gpumem_admission_open{gpu="1"} 1
gpumem_exporter_source_up{source="nvml"} 1
gpumem_exporter_source_up{source="vllm"} 1
gpumem_exporter_sample_age_seconds 2
gpumem_vllm_up{endpoint="127.0.0.1:8000"} 1
gpumem_vllm_scrape_duration_seconds{endpoint="127.0.0.1:8000"} 0.01
gpumem_vllm_scrape_errors_total{endpoint="127.0.0.1:8000",kind="timeout"} TICK
gpumem_vllm_kv_cache_usage_ratio{endpoint="127.0.0.1:8000",model="m",engine="0"} 0.4
gpumem_vllm_requests_running{endpoint="127.0.0.1:8000",model="m",engine="0"} 12
gpumem_vllm_requests_waiting{endpoint="127.0.0.1:8000",model="m",engine="0"} 0
gpumem_vllm_preemptions_total{endpoint="127.0.0.1:8000",model="m",engine="0"} TICK
gpumem_vllm_prefix_cache_queries_total{endpoint="127.0.0.1:8000",model="m",engine="0"} QUERIES
gpumem_vllm_prefix_cache_hits_total{endpoint="127.0.0.1:8000",model="m",engine="0"} TICK
gpumem_vllm_cache_config_info{endpoint="127.0.0.1:8000",block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",num_gpu_blocks="30000"} 1
gpumem_vllm_memory_budget_bytes{endpoint="127.0.0.1:8000",gpu="0",uuid="GPU-0"} 77309411328
gpumem_vllm_memory_used_bytes{endpoint="127.0.0.1:8000",gpu="0",uuid="GPU-0"} 77309411328
gpumem_vllm_memory_profile_bytes{endpoint="127.0.0.1:8000",component="weights"} 16106127360
gpumem_vllm_memory_profile_bytes{endpoint="127.0.0.1:8000",component="kv_cache"} 55834574848
gpumem_vllm_memory_profile_bytes{endpoint="127.0.0.1:8000",component="activation_peak"} 2147483648
gpumem_vllm_memory_profile_bytes{endpoint="127.0.0.1:8000",component="non_torch"} 1073741824
gpumem_vllm_memory_profile_bytes{endpoint="127.0.0.1:8000",component="cuda_graph"} 536870912
gpumem_process_torch_allocated_bytes{gpu="0",uuid="GPU-0",pid="1000",process="vllm",role="vllm",container="3f4e3f4e3f4e",pod="llama-0",namespace="inference"} ALLOCATED
gpumem_process_torch_reserved_bytes{gpu="0",uuid="GPU-0",pid="1000",process="vllm",role="vllm",container="3f4e3f4e3f4e",pod="llama-0",namespace="inference"} 75161927680
gpumem_process_non_torch_bytes{gpu="0",uuid="GPU-0",pid="1000",process="vllm",role="vllm",container="3f4e3f4e3f4e",pod="llama-0",namespace="inference"} 2147483648
gpumem_process_torch_inactive_split_bytes{gpu="0",uuid="GPU-0",pid="1000",process="vllm",role="vllm",container="3f4e3f4e3f4e",pod="llama-0",namespace="inference"} 1073741824
gpumem_process_alloc_retries_total{gpu="0",uuid="GPU-0",pid="1000",process="vllm",role="vllm",container="3f4e3f4e3f4e",pod="llama-0",namespace="inference"} TICK
gpumem_process_torch_ooms_total{gpu="0",uuid="GPU-0",pid="1000",process="vllm",role="vllm",container="3f4e3f4e3f4e",pod="llama-0",namespace="inference"} 0
"""  # noqa: E501 (exposition lines do not wrap)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    import http.server
    import itertools
    import threading
    import time
    import urllib.parse
    import urllib.request

    scrapes = itertools.count(1)

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            n = next(scrapes)
            body = (EXPOSITION.replace("QUERIES", str(4 * n)).replace("TICK", str(n))
                    .replace("ALLOCATED", str(64 * 2**30 + n * 2**20)).encode())
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    exporter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "gpu-memory-exporter", "static_configs": [
            {"targets": [f"127.0.0.1:{exporter.server_address[1]}"]}]}],
    }))
    port = free_port()
    proc = subprocess.Popen([tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def query(expr: str, at: float | None = None) -> dict:
        """An instant query, now or at `at` (Unix s): queries that must agree share one `at`."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=HANG) as response:
                return json.loads(response.read(5_000_000))
        except urllib.error.HTTPError as e:  # a bad query: Prometheus says why in the body
            return json.loads(e.read(100_000))

    try:
        deadline = time.monotonic() + 60  # bounds a hang only: a loaded machine starts Prometheus slowly
        # Two scrapes and an evaluation after them: rate() and the rules have data.
        while True:
            try:
                if query("count_over_time(up[1m]) >= 2"
                         " and on () count(instance_gpu:gpumem_memory_beyond_vllm_budget:bytes) == 2"
                         " and on () count(endpoint_model:gpumem_vllm_prefix_cache_hit:ratio_rate5m) > 0"
                         " and on () count(endpoint_model:gpumem_vllm_preemptions:rate5m) > 0")["data"]["result"]:
                    break
            except (OSError, ValueError):  # not listening yet, or a starting server's non-JSON answer
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not become ready: {proc.stderr.read().decode()[-2000:]}"
                            if proc.poll() is not None else "prometheus did not scrape in time")
            time.sleep(0.2)
        yield query
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        exporter.shutdown()


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
@pytest.mark.integration
@pytest.mark.slow
def test_every_query_returns_data_from_a_live_prometheus(prometheus, path):
    dashboard = load(path)
    exprs = queries(dashboard) + [("variable", _label_values_selector(q)) for q in variable_queries(dashboard)]
    failures = {}
    for where, expr in exprs:
        answer = prometheus(substitute(expr).replace("$__range", "1h"))
        if answer["status"] != "success":
            failures[where] = answer.get("error")
        elif not answer["data"]["result"]:
            failures[where] = f"no data: {expr}"
    assert failures == {}


@pytest.mark.integration
@pytest.mark.slow
def test_memory_budget_stack_adds_up_to_the_gpu(prometheus):
    """On the vLLM GPU the stacked parts (profile, beyond it, other, unattributed, free) make up the total."""
    stack = next(p for p in all_panels(load(GRAFANA / "dashboards" / "memory-budget.json")) if p.get("repeat") == "gpu")
    parts = [t["expr"] for t in stack["targets"][:7]]
    total = 0.0
    for expr in parts:
        result = prometheus(substitute(expr).replace('gpu=~".*"', 'gpu=~"0"'))["data"]["result"]
        total += sum(float(r["value"][1]) for r in result if r["metric"].get("gpu", "0") == "0")
    assert total == pytest.approx(85899345920)


# -- fleet views: by node and by Kubernetes namespace/pod, still right on a single host -------------
@pytest.mark.integration
@pytest.mark.slow
def test_fleet_dashboard_sums_pods_and_keeps_processes_outside_kubernetes(prometheus):
    """The vLLM process is in pod inference/llama-0, the other one in no pod: "All" (.*) shows
    both, the pod's row carries its memory and its leak flag is 0 (the leaking process is the
    one outside Kubernetes)."""
    panels = {p["title"]: p for p in all_panels(load(GRAFANA / "dashboards" / "fleet.json"))}
    [by_pod] = panels["GPU memory by pod"]["targets"]
    result = prometheus(substitute(by_pod["expr"]))["data"]["result"]
    got = {(r["metric"].get("namespace", ""), r["metric"].get("pod", "")): float(r["value"][1]) for r in result}
    assert got == {("inference", "llama-0"): 77309411328, ("", ""): 4294967296}
    leak = panels["Pods"]["targets"][3]["expr"]
    result = prometheus(substitute(leak))["data"]["result"]
    assert {(r["metric"].get("pod", ""), r["value"][1]) for r in result} == {("llama-0", "0"), ("", "1")}
    one_pod = substitute(by_pod["expr"].replace("$namespace", "inference").replace("$pod", "llama-0"))
    assert [r["metric"]["pod"] for r in prometheus(one_pod)["data"]["result"]] == ["llama-0"]


@pytest.mark.integration
@pytest.mark.slow
def test_fleet_by_node_counts_gpus_per_host(prometheus):
    node_table = next(p for p in all_panels(load(GRAFANA / "dashboards" / "fleet.json")) if p["title"] == "By node")
    result = prometheus(substitute(node_table["targets"][0]["expr"]))["data"]["result"]
    assert [(r["metric"]["instance"].startswith("127.0.0.1:"), r["value"][1]) for r in result] == [(True, "2")]


# -- the allocator probe's components ------------------------------------------------------------
def _probe_panels(path: Path) -> list[dict]:
    return [p for p in all_panels(load(path))
            if any(s in t["expr"] for t in p.get("targets", []) for s in PROBE_SERIES)]


def test_probe_panels_say_what_they_show_without_a_probe():
    """The probe's series are absent for a process without gpu-memory-probe: every panel that reads
    them says so in its description and shows that instead of a bare "No data"."""
    panels = {path.stem: _probe_panels(path) for path in DASHBOARD_FILES}
    assert len(panels["memory-budget"]) == 2 and len(panels["leak-investigation"]) == 3
    for p in [p for found in panels.values() for p in found]:
        assert "allocator probe" in p["description"] and "absent" in p["description"], p["title"]
        assert p["fieldConfig"]["defaults"]["noValue"].startswith("No allocator probe"), p["title"]


def _last_scrape(prometheus) -> float:
    """When the exporter was last scraped: every series evaluated at that instant comes from it."""
    [up] = prometheus("timestamp(up)")["data"]["result"]
    return float(up["value"][1])


def test_memory_budget_stacks_each_process_as_its_three_components(prometheus):
    """torch allocated + cached-but-free + non-torch is the process's NVML total; the process
    without a probe has no component at all (it is not shown as zero)."""
    inside = next(p for p in _probe_panels(GRAFANA / "dashboards" / "memory-budget.json") if p["type"] == "timeseries")
    assert inside["repeat"] == "gpu" and inside["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert [t["legendFormat"].rsplit(") ", 1)[1] for t in inside["targets"]] == [
        "torch allocated", "torch cached, free", "non-torch"]
    # One evaluation time for the three, the last scrape's: live tensors grow 1 MiB a scrape, so
    # queries made a scrape apart would disagree by that much.
    at = _last_scrape(prometheus)
    pids: dict[str, float] = {}
    for t in inside["targets"]:
        for r in prometheus(substitute(t["expr"]), at)["data"]["result"]:
            pids[r["metric"]["pid"]] = pids.get(r["metric"]["pid"], 0.0) + float(r["value"][1])
    assert pids == {"1000": pytest.approx(77309411328)}


def test_leak_dashboard_shows_which_component_grows(prometheus):
    """Tensors filling the cache: torch allocated grows, cached-but-free shrinks as much, non-torch
    and the NVML total stay flat."""
    [grew] = [p for p in _probe_panels(GRAFANA / "dashboards" / "leak-investigation.json") if p["type"] == "table"]
    at = _last_scrape(prometheus)  # one evaluation time: the growth is compared across the four queries
    per_hour = []
    for t in grew["targets"][:4]:
        result = prometheus(substitute(t["expr"]).replace("$__range", "1h"), at)["data"]["result"]
        per_hour.append({r["metric"]["pid"]: float(r["value"][1]) for r in result}.get("1000"))
    total, allocated, cached, non_torch = per_hour
    assert total == 0 and non_torch == 0
    assert allocated > 100 * 2**20  # 1 MiB a scrape, one scrape a second: ~3.5 GiB an hour
    assert cached == pytest.approx(-allocated)


# -- the paging stat counts what pages, on the simulator's scenarios --------------------------------
def _paging_stat_test(path: Path, name: str, expected: dict[int, int]) -> dict:
    """A promtool rule test: the real rules over the scenario's replayed series, and the stat's
    query (variables at "All") expected to be `expected[minute]` at each of those minutes."""
    [stat] = [p for p in all_panels(load(path)) if p["title"] == "GPUs paging on memory"]
    [query] = stat["targets"]
    checks = [{"expr": substitute(query["expr"]), "eval_time": f"{minute}m",
               "exp_samples": [{"labels": "{}", "value": count}]} for minute, count in expected.items()]
    return {"rule_files": [str(RULES)], "evaluation_interval": "60s",
            "tests": [{"interval": f"{STEP:g}s", "input_series": promtool_series(played(name)),
                       "promql_expr_test": checks}]}


@pytest.mark.parametrize("path", [GRAFANA / "dashboards" / "overview.json", GRAFANA / "dashboards" / "fleet.json"],
                         ids=lambda p: p.stem)
@pytest.mark.integration
@pytest.mark.slow
def test_paging_stat_counts_the_gpus_gpu_memory_high_pages_for(path, tmp_path):
    """vLLM preallocates gpu_memory_utilization x total, so on the healthy `steady` host both GPUs
    sit above the 85 % page threshold all day and nothing pages: the stat shows 0 there (it showed
    2, in orange). On `contention` a notebook's 5.6 GiB, then 8.6 GiB, beyond the vLLM budget
    (from 32 min until 2 h 30 min) takes the one GPU over: 1 while it holds them, 0 before and
    after."""
    steady = dict.fromkeys(range(0, 360, 10), 0)  # every 10 minutes of its 6 hours, loading included
    contention = {**dict.fromkeys((10, 20, 160, 170), 0), **dict.fromkeys(range(40, 150, 10), 1)}
    for name, expected in (("steady", steady), ("contention", contention)):
        test = tmp_path / f"{name}.test.yml"
        test.write_text(yaml.safe_dump(_paging_stat_test(path, name, expected), sort_keys=False, width=10**6))
        result = subprocess.run([tool("promtool"), "test", "rules", str(test)], capture_output=True, text=True,
                                timeout=600, cwd=REPO)
        assert result.returncode == 0, (name, (result.stdout + result.stderr)[-6000:])


# -- a colour or a line at GpuMemoryHigh's level only where it pages ---------------------------------
# GpuMemoryHigh pages above MEMORY_HIGH only with more than VLLM_BUDGET_SLACK of the GPU beyond the
# vLLM budgets: a vLLM GPU at its own budget (~90 % by design) sits above MEMORY_HIGH all day and
# pages nobody. A line or colour step at that level must carry the beyond-budget condition.
GPU_MEMORY_HIGH = next(a for _, group in ALERT_GROUPS for a in group if a.name == "GpuMemoryHigh")
BEYOND_BUDGET = re.compile(r"instance_gpu:gpumem_memory_beyond_vllm_budget:ratio(\{[^}]*\})? > on \(\) "
                           rf"group_left \(\) {re.escape(VLLM_BUDGET_SLACK.record)}")
PAGE_LEVELS = {MEMORY_HIGH.value, round(1 - MEMORY_HIGH.value, 6)}  # utilisation, headroom
UTILISATION_PANELS = {"overview": "GPU memory utilisation", "vllm": "GPU memory of the servers' GPUs",
                      "fleet": "Fullest GPU per node"}


def _steps(thresholds: dict | None) -> list[float]:
    return [s["value"] for s in (thresholds or {}).get("steps", []) if s["value"] is not None]


def test_the_beyond_budget_condition_is_gpu_memory_highs_own(generator):
    condition = " ".join(GPU_MEMORY_HIGH.expr.split())
    assert BEYOND_BUDGET.search(condition)
    assert generator.beyond_budget("").replace("{}", "") in condition
    assert BEYOND_BUDGET.fullmatch(generator.beyond_budget('gpu=~"$gpu"'))


def test_no_colour_or_line_at_the_page_level_without_the_beyond_budget_condition():
    """The old dashboards drew a "page threshold" line at 85 % and coloured fleet use orange from
    85 % and headroom from 15 %: every healthy vLLM GPU, which pages nobody."""
    offenders = []
    for path in DASHBOARD_FILES:
        for p in all_panels(load(path)):
            where = f"{path.stem}: {p['title']!r}"
            for t in p.get("targets", []):
                if MEMORY_HIGH.record in t["expr"] and not BEYOND_BUDGET.search(t["expr"]):
                    offenders.append(f"{where} line {t['legendFormat']!r}")
            field = p.get("fieldConfig", {})
            if PAGE_LEVELS & set(_steps(field.get("defaults", {}).get("thresholds"))):
                offenders.append(f"{where} colour step for every series")
            for o in field.get("overrides", []):
                for prop in o["properties"]:
                    if prop["id"] != "thresholds" or not PAGE_LEVELS & set(_steps(prop["value"])):
                        continue
                    # Only for the series the query marks beyond budget, by a label in their legend.
                    matcher = o["matcher"]
                    pattern = re.compile(matcher["options"].strip("/")) if matcher["id"] == "byRegexp" else None
                    marked = [t for t in p["targets"] if "{{budget}}" in t["legendFormat"] and re.search(
                        r'label_replace\(.* and on \(instance, job, gpu, uuid\) \(' + BEYOND_BUDGET.pattern
                        + r'\), "budget", "([^"]+)", "", ""\)', t["expr"])]
                    if not (pattern and marked and len(marked) == len(p["targets"]) and all(
                            pattern.search(t["legendFormat"].replace("{{budget}}", label))
                            and not pattern.search(t["legendFormat"].replace("{{budget}}", ""))
                            for t in marked for label in re.findall(r'"budget", "([^"]+)"', t["expr"]))):
                        offenders.append(f"{where} colour step for series not marked beyond budget")
    assert offenders == []


@pytest.mark.parametrize("stem", sorted(UTILISATION_PANELS))
def test_utilisation_panels_draw_both_pages(stem):
    """The near-full line (pages whoever owns the memory) always; GpuMemoryHigh's per GPU or node."""
    [panel] = [p for p in all_panels(load(GRAFANA / "dashboards" / f"{stem}.json"))
               if p["title"] == UTILISATION_PANELS[stem]]
    exprs = [t["expr"] for t in panel["targets"]]
    assert MEMORY_NEAR_FULL.record in exprs
    assert len([e for e in exprs if MEMORY_HIGH.record in e]) == 1
    for name in ("GpuMemoryNearFull", "GpuMemoryHigh", f"{VLLM_BUDGET_SLACK.value * 100:g} %", "by design"):
        assert name in panel["description"]


def _page_lines() -> list[tuple[str, str]]:
    return [(stem, t["expr"]) for stem, title in sorted(UTILISATION_PANELS.items())
            for p in all_panels(load(GRAFANA / "dashboards" / f"{stem}.json")) if p["title"] == title
            for t in p["targets"] if MEMORY_HIGH.record in t["expr"]]


def _headroom() -> str:
    [panel] = [p for p in all_panels(load(GRAFANA / "dashboards" / "overview.json")) if p["title"] == "Headroom"]
    [query] = panel["targets"]
    return query["expr"]


@pytest.mark.integration
@pytest.mark.slow
def test_only_the_gpu_beyond_its_vllm_budget_gets_the_page_line_and_the_orange_headroom(prometheus):
    """GPU 0 has 4 GiB (5 %) beyond its vLLM budget: it gets GpuMemoryHigh's line (one per GPU, or
    its node's, as GPU 0 is the fullest) and its headroom bar is marked; GPU 1 (0.6 %) neither."""
    lines = _page_lines()
    assert len(lines) == 3
    for stem, expr in lines:
        result = prometheus(substitute(expr))["data"]["result"]
        assert [(r["metric"].get("gpu"), float(r["value"][1])) for r in result] == [
            ("0" if stem != "fleet" else None, MEMORY_HIGH.value)], stem
        assert all(r["metric"].get("instance") for r in result), stem
    bars = prometheus(substitute(_headroom()))["data"]["result"]
    assert sorted((r["metric"]["gpu"], r["metric"].get("budget")) for r in bars) == [
        ("0", "beyond the vLLM budget"), ("1", None)]


def _page_level_test(name: str, minutes: dict[int, bool]) -> dict:
    """A promtool rule test over the scenario's replayed series: at each minute, every page line is
    drawn for GPU 0 (or its node) and its headroom bar marked if `minutes[minute]`, and otherwise
    no line is drawn and no bar marked."""
    gpus = len({s["series"] for s in promtool_series(played(name)) if s["series"].startswith("gpumem_gpu_info")})
    checks = []
    for minute, beyond in minutes.items():
        for stem, expr in _page_lines():
            labels = '{gpu="0",instance="sim:9842"}' if stem != "fleet" else '{instance="sim:9842"}'
            checks.append({"expr": substitute(expr), "eval_time": f"{minute}m",
                           "exp_samples": [{"labels": labels, "value": MEMORY_HIGH.value}] if beyond else []})
        marked = [{"labels": '{budget="beyond the vLLM budget"}', "value": 1}] if beyond else []
        unmarked = [{"labels": "{}", "value": gpus - beyond}] if gpus - beyond else []
        checks.append({"expr": f"count by (budget) ({substitute(_headroom())})", "eval_time": f"{minute}m",
                       "exp_samples": marked + unmarked})
    return {"rule_files": [str(RULES)], "evaluation_interval": "60s",
            "tests": [{"interval": f"{STEP:g}s", "input_series": promtool_series(played(name)),
                       "promql_expr_test": checks}]}


@pytest.mark.integration
@pytest.mark.slow
def test_a_healthy_vllm_host_draws_no_page_line_and_no_orange_headroom(tmp_path):
    """On `steady` both vLLM GPUs sit at their budget, above 85 %, all day: no GpuMemoryHigh line and
    no marked headroom bar at any time (the old dashboards drew the line through both GPUs). On
    `contention` the notebook's memory beyond the vLLM budget (from 32 min until 2 h 30 min)
    brings them while it lasts."""
    steady = dict.fromkeys(range(0, 360, 10), False)
    contention = {**dict.fromkeys((10, 20, 160, 170), False), **dict.fromkeys(range(40, 150, 10), True)}
    for name, minutes in (("steady", steady), ("contention", contention)):
        test = tmp_path / f"{name}.test.yml"
        test.write_text(yaml.safe_dump(_page_level_test(name, minutes), sort_keys=False, width=10**6))
        result = subprocess.run([tool("promtool"), "test", "rules", str(test)], capture_output=True, text=True,
                                timeout=600, cwd=REPO)
        assert result.returncode == 0, (name, (result.stdout + result.stderr)[-6000:])
