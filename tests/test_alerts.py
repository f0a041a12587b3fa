"""The alert rules, their promtool unit tests and the Alertmanager example, checked with the real
promtool, amtool and alertmanager binaries. CI installs them (Debian/Ubuntu: `apt-get install
prometheus prometheus-alertmanager`); a missing binary fails these tests, it never skips them.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request

import pytest
import yaml

from helpers.rules import (
    ALERTMANAGER_CONFIG,
    ALERTS_DIR,
    DECLARED_METRICS,
    PROMETHEUS_METRICS,
    RULES,
    alert_rules,
    load_groups,
    metric_names,
    recording_rules,
)
from helpers.tools import HANG, REPO, tool
from helpers.tools import free_port as _free_port

UNIT_TESTS = sorted((ALERTS_DIR / "tests").glob("*.yml"))
RUNBOOKS = REPO / "docs" / "runbooks"
RUNBOOK_BASE = "https://github.com/gpu-memory-exporter/gpu-memory-exporter/blob/main/docs/runbooks/"
COMPOSE = REPO / "deploy" / "compose"
SEVERITIES = {"page", "ticket"}

def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=REPO)


ALERT_NAMES = [r["alert"] for r in alert_rules()]


def unit_test_cases() -> list[dict]:
    cases = []
    for path in UNIT_TESTS:
        for group in yaml.safe_load(path.read_text())["tests"]:
            cases.extend(group.get("alert_rule_test", []))
    return cases


# -- the real tools ---------------------------------------------------------------------------
@pytest.mark.integration
def test_promtool_check_rules_accepts_the_rules():
    result = run(tool("promtool"), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules()) + len(recording_rules())} rules found" in result.stdout


@pytest.mark.integration
def test_promtool_unit_tests_pass():
    assert UNIT_TESTS, "no promtool unit tests in alerts/tests"
    result = run(tool("promtool"), "test", "rules", *map(str, UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout


@pytest.mark.integration
def test_promtool_catches_a_wrong_expectation(tmp_path):
    """The harness must be able to fail: a GPU at 50 % does not page (although all of it lies beyond
    any vLLM budget), so expecting it does fails."""
    case = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": 'gpumem_gpu_memory_total_bytes{instance="h",job="j",gpu="0",uuid="u"}', "values": "100x20"},
                {"series": 'gpumem_gpu_memory_used_bytes{instance="h",job="j",gpu="0",uuid="u"}', "values": "50x20"},
                {"series": 'gpumem_gpu_memory_beyond_budget_bytes{instance="h",job="j",gpu="0",uuid="u"}',
                 "values": "50x20"},
            ],
            "alert_rule_test": [{"eval_time": "15m", "alertname": "GpuMemoryHigh",
                                 "exp_alerts": [{"exp_labels": {"severity": "page", "instance": "h", "job": "j",
                                                                "gpu": "0", "uuid": "u"}}]}],
        }],
    }
    path = tmp_path / "wrong.test.yml"
    path.write_text(yaml.safe_dump(case))
    result = run(tool("promtool"), "test", "rules", str(path))
    assert result.returncode != 0
    assert "GpuMemoryHigh" in result.stdout + result.stderr


@pytest.mark.integration
def test_amtool_accepts_the_alertmanager_example():
    result = run(tool("amtool"), "check-config", str(ALERTMANAGER_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("severity, receiver", [("page", "pager"), ("ticket", "ticket")])
@pytest.mark.integration
def test_alertmanager_routes_by_severity(severity, receiver):
    result = run(tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}",
                 f"severity={severity}", "instance=gpu-host-1:9842", "alertname=GpuMemoryHigh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [receiver]


def test_alertmanager_groups_by_host():
    route = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())["route"]
    assert route["group_by"] == ["instance"]
    assert all("group_by" not in r or r["group_by"] == ["instance"] for r in route.get("routes", []))


# -- a real Alertmanager applies the inhibitions ------------------------------------------------
def _http(url: str, body: bytes | None = None) -> bytes:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HANG) as response:
        return response.read(1_000_000)


@pytest.fixture
def alertmanager(tmp_path):
    """The example config with its receivers pointed at a closed loopback port (no network)."""
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = "http://127.0.0.1:9/"
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = subprocess.Popen(
        [tool("alertmanager", "prometheus-alertmanager"), f"--config.file={path}",
         f"--storage.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HANG
        while True:
            try:
                _http(f"{base}/-/ready")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"alertmanager did not start: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.integration
def test_alertmanager_inhibits_what_the_example_promises(alertmanager):
    def alert(name, **labels):
        return {"labels": {"alertname": name, "job": "gpu-memory-exporter", **labels}}

    sent = [
        alert("GpuMemoryNearFull", severity="page", instance="gpu-host-1:9842", gpu="0"),
        alert("GpuMemoryHigh", severity="page", instance="gpu-host-1:9842", gpu="0"),  # same GPU: inhibited
        alert("GpuMemoryHigh", severity="page", instance="gpu-host-1:9842", gpu="1"),  # other GPU: not
        alert("GpuMemoryExporterDown", severity="page", instance="gpu-host-2:9842"),
        alert("VllmEndpointDown", severity="page", instance="gpu-host-2:9842", endpoint="e"),  # inhibited
        alert("VllmEndpointDown", severity="page", instance="gpu-host-1:9842", endpoint="e"),  # other host
    ]
    _http(f"{alertmanager}/api/v2/alerts", json.dumps(sent).encode())
    expected = {("GpuMemoryNearFull", "gpu-host-1:9842", "0"): False,
                ("GpuMemoryHigh", "gpu-host-1:9842", "0"): True,
                ("GpuMemoryHigh", "gpu-host-1:9842", "1"): False,
                ("GpuMemoryExporterDown", "gpu-host-2:9842", None): False,
                ("VllmEndpointDown", "gpu-host-2:9842", None): True,
                ("VllmEndpointDown", "gpu-host-1:9842", None): False}
    deadline = time.monotonic() + HANG
    while True:  # inhibition sees source alerts asynchronously
        got = {(a["labels"]["alertname"], a["labels"]["instance"], a["labels"].get("gpu")):
               bool(a["status"]["inhibitedBy"])
               for a in json.loads(_http(f"{alertmanager}/api/v2/alerts"))}
        if got == expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == expected


# -- every alert is complete ------------------------------------------------------------------
def test_alert_names_are_unique():
    assert len(ALERT_NAMES) == len(set(ALERT_NAMES))


@pytest.mark.parametrize("rule", alert_rules(), ids=ALERT_NAMES)
def test_alert_has_severity_text_and_runbook(rule):
    name = rule["alert"]
    assert rule["labels"]["severity"] in SEVERITIES
    annotations = rule["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    assert annotations["runbook_url"] == f"{RUNBOOK_BASE}{name}.md"
    runbook = RUNBOOKS / f"{name}.md"
    assert runbook.is_file(), f"missing runbook {runbook}"
    text = runbook.read_text()
    assert text.startswith(f"# {name}\n")
    for section in ("## What it means", "## Confirm", "## Act", "## When it is the hardware"):
        assert section in text, f"{runbook.name} lacks {section!r}"
    assert "```promql" in text, f"{runbook.name} gives no PromQL to confirm with"


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_alert_has_a_firing_and_a_silent_unit_test(name):
    cases = [c for c in unit_test_cases() if c["alertname"] == name]
    firing = [c for c in cases if c.get("exp_alerts")]
    silent = [c for c in cases if not c.get("exp_alerts")]
    assert firing, f"no promtool test where {name} fires"
    assert silent, f"no promtool test where {name} stays silent"
    for case in firing:  # exact labels and annotations, not just "something fired"
        for expected in case["exp_alerts"]:
            assert expected["exp_labels"]["severity"] in SEVERITIES
            assert set(expected["exp_annotations"]) == {"summary", "description", "runbook_url"}


GPU_PROCESS_LIST = re.compile(
    r"topk\(\d+,\s*gpumem_process_memory_used_bytes|instance_gpu:gpumem_other_process_memory:bytes")


@pytest.mark.parametrize("rule", alert_rules(), ids=ALERT_NAMES)
def test_text_on_other_processes_gpu_memory_names_host_processes_on_unified_memory(rule):
    """On a unified-memory GPU (DGX Spark / GB10) a browser's host memory is GPU memory that no GPU
    process figure shows: a description that lists the GPU's processes, or quotes what non-vLLM
    processes hold on it, must also branch on gpumem_gpu_info{unified="true"} and name the host's
    largest processes there (it said "non-vLLM processes hold 0B" while chrome held 45 GiB).
    alerts/tests/gpu-memory.test.yml renders those texts."""
    text = rule["annotations"]["description"]
    if GPU_PROCESS_LIST.search(text):
        assert 'gpumem_gpu_info{instance=%q,gpu=%q,unified=\\"true\\"}' in text, rule["alert"]
        assert "gpumem_process_host_rss_bytes{instance=%q," in text, rule["alert"]


def test_every_runbook_belongs_to_an_alert():
    pages = {p.stem for p in RUNBOOKS.glob("*.md")} - {"README"}
    assert pages == set(ALERT_NAMES)


@pytest.mark.parametrize("rule", alert_rules(), ids=ALERT_NAMES)
def test_alert_thresholds_live_in_the_threshold_rules(rule):
    """No literal threshold in an alert: numbers other than 0 and 1 belong in the threshold group."""
    expr = re.sub(r"\[[^\]]*\]|offset\s+\w+", " ", rule["expr"])  # durations are not thresholds
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    numbers = re.findall(r"(?<![\w.:])\d+(?:\.\d+)?(?![\w.])", expr)
    assert set(numbers) <= {"0", "1"}, f"{rule['alert']} compares against literals {numbers}"


def test_every_threshold_rule_is_used_by_an_alert():
    thresholds = [r["record"] for r in recording_rules() if r["record"].startswith("gpumem:threshold_")]
    assert thresholds
    alert_text = " ".join(r["expr"] for r in alert_rules())
    assert [t for t in thresholds if t not in alert_text] == []


@pytest.mark.parametrize("rule", load_groups(), ids=[g["name"] for g in load_groups()])
def test_rules_use_only_known_metrics(rule):
    recorded = {r["record"] for r in recording_rules()}
    known = DECLARED_METRICS | PROMETHEUS_METRICS | recorded
    used = set().union(*(metric_names(r["expr"]) for r in rule["rules"]))
    assert used - known == set()


def test_metric_names_finds_selectors_only():
    expr = ('sum by (instance, gpu) (rate(foo_total{role!="vllm",x=~"a|b"}[5m] offset 10m)) '
            '/ on (instance) group_left (uuid) bar:ratio > 0.5 and vector(1) unless baz')
    assert metric_names(expr) == {"foo_total", "bar:ratio", "baz"}


# -- the compose stack wires these files -------------------------------------------------------
@pytest.mark.integration
def test_compose_prometheus_config_is_valid_and_loads_the_rules():
    result = run(tool("promtool"), "check", "config", str(COMPOSE / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu-memory-exporter.rules.yml" in result.stdout


def test_compose_scrape_job_matches_the_exporter_down_alert():
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in config["scrape_configs"]}
    down = next(r for r in alert_rules() if r["alert"] == "GpuMemoryExporterDown")
    job = re.search(r'job="([^"]+)"', down["expr"]).group(1)
    assert job in jobs


def test_compose_mounts_files_that_exist():
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"exporter", "prometheus", "alertmanager", "grafana"}
    assert "--simulate" in compose["services"]["exporter"]["command"]
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (COMPOSE / source).exists(), f"compose mounts {source}, which does not exist"


# -- one declaration: the rules file and its tables are generated ------------------------------
def test_generated_rules_and_tables_are_up_to_date():
    """alerts/gpu-memory-exporter.rules.yml and the tables in alerts/README.md and
    docs/runbooks/README.md are written by `python -m alerts.generate`; a hand edit or a changed
    declaration that was not regenerated fails here."""
    from alerts.generate import outputs

    stale = [str(path.relative_to(REPO)) for path, text in outputs().items() if path.read_text() != text]
    assert stale == [], f"run `python -m alerts.generate`: {stale} differ from the declarations"


def test_the_generator_check_mode_fails_on_a_stale_file(tmp_path, monkeypatch):
    import alerts.generate as generate

    copy = tmp_path / "rules.yml"
    copy.write_text(RULES.read_text().replace("for: 5m", "for: 6m", 1))
    monkeypatch.setattr(generate, "RULES", copy)
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0 and generate.main(["--check"]) == 0  # rewritten, then current
    assert copy.read_text() == RULES.read_text()


def test_every_finding_kind_has_an_alert_a_runbook_and_a_scenario():
    """Issue 19: every kind the detectors raise reaches an alert (with its runbook and promtool
    tests, checked per alert above) and has a built-in scenario that shows it."""
    from exporter.analysis.registry import finding_kinds
    from exporter.sim.scenario import builtin

    scenarios = {listed.name for listed in builtin()}
    for kind in finding_kinds():
        assert kind.alerts and set(kind.alerts) <= set(ALERT_NAMES), kind.name
        assert kind.scenario in scenarios, f"{kind.name}: no scenario {kind.scenario}"


def test_alerts_on_findings_fire_from_the_finding_alone():
    """One decision per verdict: an alert declared for a finding kind reads only that finding;
    its thresholds are the detector's."""
    from alerts.generate import finding_expr
    from exporter.analysis.registry import finding_kinds

    by_name = {r["alert"]: r for r in alert_rules()}
    declared = [k for k in finding_kinds() if k.alert is not None]
    assert declared
    for kind in declared:
        rule = by_name[kind.alert.name]
        assert rule["expr"] == finding_expr(kind.name)
        assert rule["labels"]["severity"] == kind.alert.severity


def test_a_raw_rule_and_the_daemon_read_the_same_thresholds():
    """GpuMemoryHigh/NearFull judge the pressure finding's condition over raw series: their
    recording rules carry the numbers the daemon's PressureConfig defaults to."""
    from exporter import thresholds
    from exporter.analysis.pressure import PressureConfig

    records = {r["record"]: r["expr"] for r in recording_rules()}
    config = PressureConfig()
    for threshold, value in ((thresholds.MEMORY_HIGH, config.warning_ratio),
                             (thresholds.MEMORY_NEAR_FULL, config.critical_ratio),
                             (thresholds.VLLM_BUDGET_SLACK, config.budget_slack_ratio)):
        assert records[threshold.record] == f"vector({value:g})"


FINDING_LABELS = ("gpu", "pid", "process", "role", "endpoint")


@pytest.mark.slow
def test_the_rule_tests_feed_findings_shaped_as_the_exporter_exports_them():
    """A rule test whose gpumem_finding_active carries labels the exporter never sets for that
    kind checks a text no alert will read: GpuMemoryContention named `$labels.process` and the
    server's `$labels.endpoint`, which its finding (one per GPU or host, whoever holds the memory,
    so that it lasts while they change) never carries; live, the alert named nobody. Every kind a
    built-in scenario raises is checked against the labels it is raised with there."""
    from exporter.sim.scenario.load import builtin
    from helpers.scenarios import played

    raised: dict[str, set[frozenset[str]]] = {}
    for listed in builtin():
        for f in played(listed.name).all_findings:
            raised.setdefault(f.kind, set()).add(frozenset(k for k in FINDING_LABELS if getattr(f, k)))
    fed: set[tuple[str, frozenset[str]]] = set()
    for path in UNIT_TESTS:
        for group in yaml.safe_load(path.read_text())["tests"]:
            for series in group.get("input_series", []):
                if series["series"].startswith("gpumem_finding_active{"):
                    labels = dict(re.findall(r'(\w+)="([^"]*)"', series["series"]))
                    fed.add((labels["kind"], frozenset(k for k in FINDING_LABELS if labels.get(k))))
    checked = {(kind, keys) for kind, keys in fed if kind in raised}
    assert {kind for kind, _ in checked} >= {"contention", "leak", "stale_memory"}
    assert {(kind, tuple(sorted(keys))) for kind, keys in checked
            if not any(keys <= shape for shape in raised[kind])} == set()
