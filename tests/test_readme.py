"""The first hour (#19 item 6): the README's commands work right after `make run`, as written, in a
shell whose PATH does not hold the virtual environment, and the post-mortem recipe's report has
its plots."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers.tools import HANG, REPO, free_port

README = (REPO / "README.md").read_text()
# The one section whose commands run after `pip install`, where the command is on PATH.
PIP_SECTION = README[README.index("## Quick start on a GPU host"):README.index("### Post-mortem")]
COMMAND = re.compile(r"(?:^|[;&|]\s*|timeout \d+ |\$ )((?:\.venv/bin/)?gpu-memory-exporter)\b", re.MULTILINE)


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:sh|text)\n(.*?)```", text, re.DOTALL)


def test_every_command_after_make_run_is_spelled_as_make_run_installs_it():
    """`make run` puts the command in .venv/bin, not on PATH: a README command written bare fails
    with "command not found" until the venv is activated."""
    outside = README.replace(PIP_SECTION, "")
    called = [m.group(1) for block in shell_blocks(outside) for m in COMMAND.finditer(block)]
    assert called and set(called) == {".venv/bin/gpu-memory-exporter"}, called
    inline = re.findall(r"`((?:\.venv/bin/)?gpu-memory-exporter) [a-z]", outside)
    assert set(inline) <= {".venv/bin/gpu-memory-exporter"}, inline


def test_make_run_installs_the_report_extra_and_the_command_where_the_readme_calls_it(tmp_path):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    plan = subprocess.run([make, "-n", "-B", f"VENV={venv}", f"{venv}/.installed"], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG, check=True).stdout
    assert re.search(r"pip install -q (?:-e \S+ )*-e '\.\[report\]'", plan), plan
    dry = subprocess.run([make, "-n", "run", "SCENARIO=steady"], cwd=REPO, capture_output=True, text=True,
                         timeout=HANG, check=True).stdout
    assert ".venv/bin/gpu-memory-exporter run --simulate" in dry


def _recipe() -> list[str]:
    section = README[README.index("### Post-mortem"):README.index("A trace is a CSV")]
    lines, current = [], ""
    for line in shell_blocks(section)[0].splitlines():
        current += re.sub(r"\s+#.*$", "", line).rstrip("\\").rstrip() + " "
        if not line.rstrip().endswith("\\"):
            lines.append(current.strip())
            current = ""
    return lines


@pytest.mark.integration
@pytest.mark.slow
def test_the_post_mortem_recipe_runs_as_written_and_its_report_has_plots(tmp_path):
    """The recipe's lines, run by bash in a directory whose .venv is the one running these tests,
    with a PATH without it. Two changes, neither to a command: the daemon listens on a free port
    (9843 may be taken), and it is stopped once its trace is written rather than after 20 s (so
    the test waits on the file, not on the time the simulated server takes to exit)."""
    pytest.importorskip("matplotlib")
    prepare, run, analyze = _recipe()
    assert run.startswith("timeout 20 .venv/bin/gpu-memory-exporter run ") and "--listen 127.0.0.1:9843" in run
    venv = Path(sys.prefix)  # the environment running the tests: `make test` runs them in .venv
    if not (venv / "bin" / "gpu-memory-exporter").exists():
        pytest.skip("the tests do not run in a virtual environment with the command installed")
    (tmp_path / ".venv").symlink_to(venv)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    subprocess.run(["bash", "-c", prepare], cwd=tmp_path, env=env, check=True, timeout=HANG)
    daemon = subprocess.Popen(["bash", "-c", "exec " + run.replace("timeout 20 ", "").replace(
        "127.0.0.1:9843", f"127.0.0.1:{free_port()}")], cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG
        while not list((tmp_path / "traces").glob("gpumem-*.csv")) and time.monotonic() < deadline:
            assert daemon.poll() is None, daemon.stderr.read()
            time.sleep(0.2)
    finally:
        daemon.send_signal(signal.SIGTERM)  # what `timeout` sends
        daemon.wait(timeout=HANG)
    assert list((tmp_path / "traces").glob("gpumem-*.csv")), "no trace written"
    done = subprocess.run(["bash", "-c", analyze], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=HANG)
    assert done.returncode == 0, done.stderr
    assert "stale_memory" in done.stdout and "Flight recorder trigger: vllm_exit" in done.stdout
    report = (tmp_path / "incident.html").read_text()
    assert "data:image/png;base64," in report and "Plots are left out" not in report
    assert os.path.getsize(tmp_path / "incident.html") > 10_000


def test_the_vllm_cpu_recipe_config_is_accepted_as_written(tmp_path):
    """docs/vllm-cpu.md has a newcomer write vllm-cpu.yml from a heredoc: `check-config` accepts
    it, and it listens on this machine only."""
    doc = (REPO / "docs" / "vllm-cpu.md").read_text()
    heredoc = re.search(r"cat > vllm-cpu\.yml <<'EOF'\n(.*?)\nEOF\n", doc, re.DOTALL)
    assert heredoc, "docs/vllm-cpu.md: no vllm-cpu.yml heredoc"
    config = tmp_path / "vllm-cpu.yml"
    config.write_text(heredoc.group(1) + "\n")
    checked = subprocess.run([sys.executable, "-m", "exporter", "check-config", str(config)],
                             capture_output=True, text=True, timeout=HANG, cwd=REPO)
    assert checked.returncode == 0, checked.stderr
    assert yaml.safe_load(heredoc.group(1))["listen"].startswith("127.0.0.1:")
