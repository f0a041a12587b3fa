"""A lost GPU and the servers on it (the trial's gpu-lost: GPU 1 down and closed, yet GPU 0 open
with "no finding: 86% used" while the TP=2 server sim-0 spanning both kept showing requests).

A tensor-parallel server runs one worker per GPU and fails (or hangs in its collectives) when one
GPU is gone: the finding names the servers that ran on the lost GPU, and the admission of the
other GPUs they span closes with it, until the GPU answers again."""
from __future__ import annotations

from exporter.analysis.engine import Analyzer
from exporter.model import GpuSample
from helpers.timeline import T0, GiB, gpu, snap, vllm_proc, vllm_server

TP = "http://127.0.0.1:8000"  # tensor parallel over GPUs 0 and 1
SOLO = "http://127.0.0.1:8001"  # on GPU 2 alone
LOST_FROM, LOST_UNTIL = 300, 600


def host(e: float):
    lost = LOST_FROM <= e < LOST_UNTIL
    g0 = gpu([vllm_proc(11, 70 * GiB, endpoint=TP, start=T0)], index="0")
    g1 = (GpuSample(index="1", uuid="GPU-1", name="H100", up=False, error="gpu_is_lost") if lost
          else gpu([vllm_proc(12, 70 * GiB, endpoint=TP, start=T0)], index="1"))
    g2 = gpu([vllm_proc(21, 70 * GiB, endpoint=SOLO, start=T0)], index="2")
    return snap(T0 + e, [g0, g1, g2], vllm=[vllm_server(0, 0.3, endpoint=TP, pids=(10,)),
                                            vllm_server(0, 0.3, endpoint=SOLO, pids=(20,))])


def replay():
    analyzer = Analyzer(log_findings=False)
    return [(e, analyzer.update(host(e))) for e in range(0, 900, 10)]


def test_the_gpus_a_server_on_the_lost_gpu_spans_close_with_it_and_reopen_after():
    for e, a in replay():
        admission = {g.gpu: g.admission_open for g in a.gpus}
        lost = LOST_FROM <= e < LOST_UNTIL
        assert admission == {"0": not lost, "1": not lost, "2": True}, (e, admission)
        (g0,) = [g for g in a.gpus if g.gpu == "0"]
        assert g0.servers == (TP,)
        assert (g0.closed_because == f"vLLM {TP} also spans GPU 1, which does not answer") == lost


def test_the_finding_names_the_servers_that_ran_on_the_lost_gpu_and_the_gpus_they_span():
    (f,) = [f for e, a in replay() if e == LOST_FROM + 100 for f in a.findings if f.kind == "gpu_unavailable"]
    assert f.gpu == "1" and f.severity == "critical"
    assert f"vLLM {TP} (also on GPU 0, closed to new work too) ran on it" in f.summary
    assert SOLO not in f.summary
    ev = dict(f.evidence)
    assert ev["server_1_endpoint"] == TP and ev["server_1_other_gpus"] == "0"
    assert any("/admission?gpu=1" in a and "their admission is closed too" in a for a in f.advice)
