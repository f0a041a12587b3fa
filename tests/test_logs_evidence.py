"""Logs are evidence, not commands (#21 item 3, M3): an out-of-memory message quoted inside a
request (vLLM's request logger prints prompts and outputs; uvicorn's access log prints request
lines) is not an incident. Real OOM lines are recognised by where they appear in vLLM's and
PyTorch's own output; the record formats below are the loggers' own (vllm/entrypoints/logger.py
across releases, vllm's ignored-fields warning, uvicorn's access log as vLLM runs it)."""
from __future__ import annotations

import pytest

from exporter.analysis.engine import Analyzer
from exporter.model import GpuSample, ProcessSample, Snapshot
from exporter.sources.logs import LogSource
from exporter.sources.oom_messages import parse_lines
from exporter.sources.source import collect

GiB = 1 << 30
NOW = 1_700_000_000.0

# What a prompt would quote: a complete PyTorch OOM naming another process to stop.
QUOTED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
          "capacity of 79.15 GiB of which 1.06 GiB is free. Process 4242 has 60.00 GiB memory in use. "
          "Including non-PyTorch memory, this process has 18.00 GiB memory in use. Of the allocated memory "
          "16.50 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated. If reserved "
          "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
          "avoid fragmentation.  See documentation for Memory Management  "
          "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")

REQUEST_RECORDS = [
    # vLLM <= 0.9: the prompt's repr in the INFO record (its "\n" escaped, as %r prints it).
    "INFO 06-12 09:14:03 [logger.py:43] Received request chatcmpl-5f0c1e: prompt: '<|user|>\\nRepeat after "
    f"me:\\n{QUOTED}\\n<|assistant|>\\n', params: SamplingParams(n=1, temperature=0.7, max_tokens=512), "
    "prompt_token_ids: None, prompt_embeds shape: None, lora_request: None, prompt_adapter_request: None.",
    # vLLM 0.10+: the prompt at DEBUG, behind the API server's process tag.
    f"(APIServer pid=12) DEBUG 06-12 09:14:03 [logger.py:39] Request cmpl-77 details: prompt: '{QUOTED}', "
    "prompt_token_ids: None, prompt_embeds shape: None.",
    # The model's answer, as --enable-log-outputs prints it.
    f"(APIServer pid=12) INFO 06-12 09:14:04 [logger.py:70] Generated response cmpl-77: output: '{QUOTED}', "
    "output_token_ids: None, finish_reason: stop",
    # A request id the client chose (X-Request-Id), quoted by the INFO record.
    f"(APIServer pid=12) INFO 06-12 09:14:03 [logger.py:52] Received request chatcmpl-x {QUOTED}: "
    "params: SamplingParams(n=1), lora_request: None.",
    # The request's JSON keys vLLM ignored, quoted by a WARNING.
    f"(APIServer pid=12) WARNING 06-12 09:14:03 [protocol.py:88] The following fields were present in the "
    f"request but ignored: {{'{QUOTED}'}}",
    # uvicorn's access log: the path is percent-quoted, so only spaceless tokens survive in it.
    'INFO:     10.0.0.7:51234 - "GET /cudaErrorMemoryAllocation HTTP/1.1" 404 Not Found',
    '(APIServer pid=12) INFO:     10.0.0.7:51236 - "GET /v1/models?q=CUDA_ERROR_OUT_OF_MEMORY HTTP/1.1" 200 OK',
]

# The real thing, in the same log: vLLM's worker logging the exception it died of.
REAL = [
    "(VllmWorker rank=0 pid=123) ERROR 06-12 09:20:00 [multiproc_executor.py:527] Traceback (most recent call last):",
    '(VllmWorker rank=0 pid=123) ERROR 06-12 09:20:00 [multiproc_executor.py:527]   File "gpu_model_runner.py", '
    "line 1500, in execute_model",
    f"(VllmWorker rank=0 pid=123) ERROR 06-12 09:20:00 [multiproc_executor.py:527] {QUOTED}",
]


@pytest.mark.parametrize("record", REQUEST_RECORDS)
def test_an_oom_message_quoted_in_a_request_record_is_no_event(record):
    assert parse_lines([record]) == []


def test_the_real_oom_beside_quoted_ones_is_still_one_event():
    events = parse_lines(REQUEST_RECORDS + REAL + REQUEST_RECORDS)
    assert [(e.kind, e.line, e.requested_bytes) for e in events] == [
        ("torch_cuda_oom", len(REQUEST_RECORDS) + 3, 20 * GiB)]


def gpus():
    vllm = ProcessSample(pid=123, used_bytes=78 * GiB, name="VLLM::Worker", role="vllm", start_time=NOW - 600)
    victim = ProcessSample(pid=4242, used_bytes=GiB, name="python3", start_time=NOW - 600)
    return (GpuSample(index="0", uuid="GPU-a", total_bytes=80 * GiB, used_bytes=79 * GiB,
                      free_bytes=GiB, processes=(vllm, victim)),)


def test_a_prompt_quoting_an_oom_raises_no_finding_no_trace_and_no_advice(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("")
    source, analyzer = LogSource([str(log)]), Analyzer(log_findings=False)
    analyzer.update(collect(source, Snapshot(NOW, gpus=gpus())))
    with open(log, "a") as fh:
        fh.write("\n".join(REQUEST_RECORDS) + "\n")
    analysis = analyzer.update(collect(source, Snapshot(NOW + 5, gpus=gpus())))
    assert analysis.oom_events == ()
    assert "oom" not in analysis.transitions  # no flight-recorder trace
    assert [f for f in analysis.findings if f.kind == "oom"] == []  # no finding, no alert, no advice

    with open(log, "a") as fh:  # the worker then really runs out of memory
        fh.write("\n".join(REAL) + "\n")
    analysis = analyzer.update(collect(source, Snapshot(NOW + 10, gpus=gpus())))
    assert [e.kind for e in analysis.oom_events] == ["torch_cuda_oom"] and "oom" in analysis.transitions
    (oom,) = [f for f in analysis.findings if f.kind == "oom"]
    assert oom.severity == "critical"
