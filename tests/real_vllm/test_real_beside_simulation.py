"""A real vLLM endpoint beside a simulated host is never taken for the simulated server (#18
defect 1): `run --simulate steady --vllm-endpoint http://127.0.0.1:8000/metrics`, where the
scenario's server and the real one both name port 8000, gave the real endpoint the simulated
server's processes (73.7 GB per simulated GPU, even while the real server was down) and left the
simulated server none. Here the scenario's server names the real server's port, whatever port
the session's server got.
"""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.sim.scenario.load import SCENARIO_DIR
from helpers import real_vllm
from helpers.daemon import Daemon

pytestmark = [pytest.mark.real_vllm, pytest.mark.integration, pytest.mark.slow]


def test_the_real_endpoint_and_the_simulated_server_keep_their_own(main_server, tmp_path):
    steady = (SCENARIO_DIR / "steady.yaml").read_text()
    assert "  - port: 8000\n" in steady
    scenario = tmp_path / "steady.yaml"
    scenario.write_text(steady.replace("  - port: 8000\n", f"  - port: {main_server.port}\n"))
    daemon = Daemon("--simulate", str(scenario), "--vllm-endpoint", main_server.metrics_url, "--interval", "0.5")
    try:
        daemon.wait_healthy()
        page = real_vllm.wait_until(lambda: _page_with_budgets(daemon), 60.0, "the simulated server's budget")
    finally:
        daemon.stop()
    real = main_server.metrics_url
    assert page["gpumem_vllm_up"] == {(("endpoint", real),): 1.0, (("endpoint", "sim-0"),): 1.0}
    # The simulated server's two workers hold its memory on both simulated GPUs (loading its
    # weights at first); the real server's processes are not on a simulated GPU at all.
    assert {dict(labels)["endpoint"] for labels in page["gpumem_vllm_memory_used_bytes"]} == {"sim-0"}
    assert len(page["gpumem_vllm_memory_used_bytes"]) == 2
    assert all(v > 0 for v in page["gpumem_vllm_memory_used_bytes"].values())
    # The real endpoint is still read: its own page's values, under its own label.
    models = {dict(labels)["model"] for labels in page["gpumem_vllm_requests_running"]
              if dict(labels)["endpoint"] == real}
    assert models == {main_server.served_model_name}


def _page_with_budgets(daemon: Daemon) -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
    page: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(daemon.get("/metrics").text):
        for s in family.samples:
            page.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return page if page.get("gpumem_vllm_memory_used_bytes") and page.get("gpumem_vllm_requests_running") else None
