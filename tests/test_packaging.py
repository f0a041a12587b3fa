"""The image cannot be built here, so build what it builds: the Dockerfile's build stage turns its
COPY'd files into wheels (the package and its dependencies), the final stage installs those wheels.
Here the same wheels go into a fresh virtual environment (no editable install, no repository on
sys.path) and the daemon is started from it: a missing package file, a wrong entry point or a
dependency left out of the metadata fails here rather than in the image."""
from __future__ import annotations

import email
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import venv
import zipfile
from pathlib import Path

import pytest

from exporter import __version__
from helpers.tools import HANG

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def build_stage() -> str:
    stages = re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.MULTILINE)[1:]
    [build] = [s for s in stages if s.split("\n", 1)[0].endswith(" AS build")]
    return build


def build_stage_copies() -> list[tuple[str, str]]:
    """(source, destination) for each file or folder the Dockerfile's build stage copies from the
    repository, the destination relative to its WORKDIR."""
    copies = []
    for line in build_stage().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            *sources, dest = line.split()[1:]
            copies += [(s, str(Path(dest) / s) if dest.endswith("/") else dest) for s in sources]
    return copies


def build_stage_wheel_targets() -> list[str]:
    """What the build stage's `pip wheel` builds (paths relative to its WORKDIR), in its order."""
    [line] = [line for line in build_stage().splitlines() if line.startswith("RUN pip wheel ")]
    words = line.split()[3:]
    return [w for i, w in enumerate(words) if not w.startswith("-") and words[i - 1] != "--wheel-dir"]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """`pip wheel .` over a build context holding only what the Dockerfile copies."""
    tmp = tmp_path_factory.mktemp("image")
    context = tmp / "src"
    context.mkdir()
    for source, dest in build_stage_copies():
        path = REPO / source
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, context / dest)
    wheels = tmp / "wheels"
    targets = [str(context / target) for target in build_stage_wheel_targets()]
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels), *targets],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return wheels


def test_the_build_stage_copies_what_the_package_needs():
    """pyproject.toml names README.md (readme) and LICENSE (license-files): without them the build
    fails or the wheel ships without its licence. The exporter depends on the probe's distribution
    (gpumem_probe.schema), which is not on an index: the build stage builds it from ./probe."""
    assert {"pyproject.toml", "README.md", "LICENSE", "exporter", "probe"} <= {s for s, _ in build_stage_copies()}
    assert build_stage_wheel_targets() == ["./probe", "."]


@pytest.mark.slow
@pytest.mark.integration
def test_the_wheel_declares_its_license_and_version_and_ships_the_scenarios(wheelhouse):
    [wheel] = wheelhouse.glob("gpu_memory_exporter-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        [metadata_name] = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(z.read(metadata_name))
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert len(licenses) == 1, f"the wheel carries no LICENSE: {names}"
        assert z.read(licenses[0]) == (REPO / "LICENSE").read_bytes()
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Version"] == __version__
    scenarios = {n.rsplit("/", 1)[1] for n in names if n.startswith("exporter/sim/scenarios/")}
    assert scenarios == {p.name for p in (REPO / "exporter" / "sim" / "scenarios").glob("*.yaml")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=HANG) as response:
            return response.status, response.read(1_000_000)
    except urllib.error.HTTPError as e:
        return e.code, e.read(100_000)


@pytest.mark.slow
@pytest.mark.integration
def test_the_installed_wheels_serve_healthz(wheelhouse, tmp_path):
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    # Like the image's `pip install /wheels/*.whl`, and with no index: the wheelhouse must be complete.
    install = subprocess.run([str(bin_dir / "pip"), "install", "--quiet", "--no-index",
                              *map(str, wheelhouse.glob("*.whl"))], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]

    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(bin_dir / "python"), "-c", "import exporter; print(exporter.__file__)"],
                           cwd=tmp_path, env=clean_env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    imported_from = Path(where.stdout.strip()).resolve()
    assert imported_from.is_relative_to(env_dir.resolve()), f"exporter imported from {imported_from}"
    version = subprocess.run([str(bin_dir / "gpu-memory-exporter"), "--version"],
                             cwd=tmp_path, env=clean_env, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.split()[-1] == __version__, version.stderr

    port = _free_port()
    log = (tmp_path / "daemon.log").open("w+")
    daemon = subprocess.Popen([str(bin_dir / "gpu-memory-exporter"), "run", "--simulate", "steady",
                               "--listen", f"127.0.0.1:{port}"],
                              cwd=tmp_path, env=clean_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # generous: a loaded CI machine; the loop ends on success
        status = None
        while status != 200:
            assert daemon.poll() is None, f"the daemon exited: {(tmp_path / 'daemon.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no 200 from /healthz (last: {status})"
            try:
                status, _ = _get(f"http://127.0.0.1:{port}/healthz")
            except OSError:
                status = None
            if status != 200:
                time.sleep(0.2)
        status, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        assert re.search(rf'^gpumem_exporter_build_info\{{.*version="{re.escape(__version__)}".*\}} 1\.0$',
                         body.decode(), re.MULTILINE)
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
