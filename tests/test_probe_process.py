"""The allocator probe in real processes: loaded as vLLM loads it (through the installed
distribution's entry point), its thread, fork children, and its file removed at exit.

CUDA cannot exist here: `torch` is the stand-in in tests/fixtures/probe/standin_torch. Every
wait is on a condition with a generous deadline, never on a duration.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STANDIN_TORCH = ROOT / "tests" / "fixtures" / "probe" / "standin_torch"
PROBE_SOURCE = ROOT / "probe"
DEADLINE = 120  # seconds; only ever reached when something is broken

WAIT_FOR_OWN_FILE = f"""
def wait_for_own_file(directory):
    import os, time
    deadline = time.monotonic() + {DEADLINE}
    while time.monotonic() < deadline:
        if any(n.endswith(f"-{{os.getpid()}}.json") for n in os.listdir(directory)):
            return sorted(os.listdir(directory))
        time.sleep(0.02)
    raise SystemExit("the probe never wrote its file")
"""


def run(script: str, directory: Path, *path: Path, extra_env: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH")}
    env.update(GPUMEM_PROBE_DIR=str(directory), GPUMEM_PROBE_INTERVAL="0.5",
               PYTHONPATH=os.pathsep.join(str(p) for p in path), **(extra_env or {}))
    done = subprocess.run([sys.executable, "-c", WAIT_FOR_OWN_FILE + script], env=env, capture_output=True,
                          text=True, timeout=DEADLINE * 2, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_loaded_twice_one_thread_writes_and_the_file_goes_at_exit(tmp_path):
    out = run("""
import json, os, threading
import torch
import gpumem_probe
gpumem_probe.register()
gpumem_probe.register()
threads = sum(t.name == "gpumem-probe" for t in threading.enumerate())
torch.cuda.init()
print(json.dumps({"threads": threads, "files": wait_for_own_file(os.environ["GPUMEM_PROBE_DIR"]), "pid": os.getpid()}))
""", tmp_path, STANDIN_TORCH, PROBE_SOURCE)
    assert out["threads"] == 1
    assert len(out["files"]) == 1 and out["files"][0].endswith(f"-{out['pid']}.json")
    assert list(tmp_path.iterdir()) == []  # removed at exit


@pytest.mark.integration
def test_a_process_that_never_initialises_cuda_writes_nothing_and_never_imports_torch(tmp_path):
    # vLLM's API server loads the plugins too, and never uses CUDA.
    script = """
import json, sys, time
{imports}
import gpumem_probe
from gpumem_probe.probe import start
gpumem_probe.register()
probe = start()
deadline = time.monotonic() + 120
while probe.polls < 3 and time.monotonic() < deadline:
    time.sleep(0.02)
torch = sys.modules.get("torch")
print(json.dumps({{"polls": probe.polls, "torch": torch is not None,
                  "calls": torch.cuda.calls if torch else {{}}}}))
"""
    with_torch = run(script.format(imports="import torch"), tmp_path, STANDIN_TORCH, PROBE_SOURCE)
    assert with_torch["polls"] >= 3 and set(with_torch["calls"]) == {"is_initialized"}
    without = run(script.format(imports=""), tmp_path, STANDIN_TORCH, PROBE_SOURCE)
    assert without["polls"] >= 3 and without["torch"] is False
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_a_forked_worker_gets_its_own_probe_and_its_file_goes_when_it_exits(tmp_path):
    # vLLM forks its engine and workers from a process that loaded the plugins; the child
    # inherits vLLM's "plugins loaded" flag, so nothing calls register() in it again.
    out = run("""
import json, os
import multiprocessing
import torch
import gpumem_probe

def worker(queue):
    torch.cuda.init()
    queue.put((os.getpid(), wait_for_own_file(os.environ["GPUMEM_PROBE_DIR"])))

if __name__ == "__main__":
    gpumem_probe.register()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=worker, args=(queue,))
    child.start()
    pid, listing = queue.get(timeout=120)
    child.join(120)
    print(json.dumps({"pid": pid, "listing": listing, "exitcode": child.exitcode,
                      "after": sorted(os.listdir(os.environ["GPUMEM_PROBE_DIR"]))}))
""", tmp_path, STANDIN_TORCH, PROBE_SOURCE)
    assert out["exitcode"] == 0
    assert len(out["listing"]) == 1 and out["listing"][0].endswith(f"-{out['pid']}.json")
    assert out["after"] == []  # a multiprocessing child leaves through os._exit: no atexit there


# vLLM's plugin loader (vllm/plugins/__init__.py: load_plugins_by_group, load_general_plugins),
# reproduced step by step: entry points of the group, the VLLM_PLUGINS allow-list (unset: all;
# else a comma-separated list of names), plugin.load(), then each function called.
VLLM_LOADER = """
import json, os, sys, threading
from importlib.metadata import entry_points
import torch

DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
plugins_loaded = False

def load_plugins_by_group(group):
    allowed_plugins = None if "VLLM_PLUGINS" not in os.environ else os.environ["VLLM_PLUGINS"].split(",")
    discovered_plugins = entry_points(group=group)
    if len(discovered_plugins) == 0:
        return {}
    plugins = {}
    for plugin in discovered_plugins:
        if allowed_plugins is None or plugin.name in allowed_plugins:
            try:
                plugins[plugin.name] = plugin.load()
            except Exception:
                pass
    return plugins

def load_general_plugins():
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    for func in load_plugins_by_group(DEFAULT_PLUGINS_GROUP).values():
        func()

load_general_plugins()
load_general_plugins()
for func in load_plugins_by_group(DEFAULT_PLUGINS_GROUP).values():
    func()  # and once more past the guard: the plugin must not care
found = [[ep.name, ep.value, ep.dist.name] for ep in entry_points(group=DEFAULT_PLUGINS_GROUP)]
module = sys.modules.get("gpumem_probe")
threads = sum(t.name == "gpumem-probe" for t in threading.enumerate())
files = []
if module is not None:
    torch.cuda.init()
    files = wait_for_own_file(os.environ["GPUMEM_PROBE_DIR"])
print(json.dumps({"found": found, "module": module and module.__file__, "threads": threads, "files": files}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The probe built and installed as a user would (pip, its own pyproject), offline, into a
    folder of its own: its entry point exists only as the installed distribution's metadata."""
    work = tmp_path_factory.mktemp("probe-install")
    source = work / "source"  # a copy: building writes metadata next to the sources
    shutil.copytree(PROBE_SOURCE, source, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    target = work / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--no-build-isolation", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, "building the probe needs setuptools>=77 (the test extra): " + done.stderr
    return target


@pytest.mark.parametrize("allow", [None, "gpumem_probe", "another_plugin,gpumem_probe"])
@pytest.mark.integration
def test_vllm_discovers_and_loads_the_installed_plugin(installed, tmp_path, allow):
    out = run(VLLM_LOADER, tmp_path, installed, STANDIN_TORCH,
              extra_env={} if allow is None else {"VLLM_PLUGINS": allow})
    assert out["found"] == [["gpumem_probe", "gpumem_probe:register", "gpu-memory-probe"]]
    assert Path(out["module"]).is_relative_to(installed)
    assert out["threads"] == 1
    assert len(out["files"]) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_vllm_plugins_allow_list_without_the_probe_keeps_it_out(installed, tmp_path):
    out = run(VLLM_LOADER, tmp_path, installed, STANDIN_TORCH, extra_env={"VLLM_PLUGINS": "another_plugin"})
    assert out["found"] == [["gpumem_probe", "gpumem_probe:register", "gpu-memory-probe"]]
    assert out["module"] is None and out["threads"] == 0 and out["files"] == []
