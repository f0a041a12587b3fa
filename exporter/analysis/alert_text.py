"""Pieces of alert text (Prometheus templates) that more than one alert's description uses: the
raw-series alerts of alerts/rules.py and the alerts the detectors declare for their findings.

On a unified-memory GPU (gpumem_gpu_info{unified="true"}: DGX Spark / GB10, Grace Hopper with ATS)
the GPU takes its memory from the host, so a browser's resident memory is GPU memory there, while
the GPU library's per-process figures show only what runs on the GPU. A description that quotes
per-process GPU memory must say so on such a GPU and name the host's largest processes
(gpumem_process_host_rss_bytes, which carries them there), not print "others hold 0B".
"""
from __future__ import annotations

# Opens `{{ if }}`: true where the alert's GPU ($labels.instance, $labels.gpu) shares host memory.
IF_UNIFIED_GPU = ('{{ if printf "gpumem_gpu_info{instance=%q,gpu=%q,unified=\\"true\\"}" '
                  "$labels.instance $labels.gpu | query }}")


# Label matchers of the processes' series, with the printf arguments that fill them in: on the
# alert's host, or on its GPU; "outside vLLM" leaves the servers' own processes out.
ON_HOST = ("instance=%q", "$labels.instance")
ON_GPU = ("instance=%q,gpu=%q", "$labels.instance $labels.gpu")
OUTSIDE_VLLM = ',role!=\\"vllm\\"'


def _query(expr: str, where: tuple[str, str], outside_vllm: bool) -> str:
    """`expr` (with {} for the matchers) as a template pipeline that runs it."""
    matchers = where[0] + (OUTSIDE_VLLM if outside_vllm else "")
    return f'printf "{expr.format("{" + matchers + "}")}" {where[1]} | query'


def process_list(family: str, where: tuple[str, str], item: str, outside_vllm: bool = False) -> str:
    """The three largest series of `family` `where` (ON_HOST, ON_GPU), each as " `item`" (a template
    for one result, `.`), joined by ";" and ended with "." (" none listed." without any)."""
    query = _query(f"sort_desc(topk(3, {family}{{}}))", where, outside_vllm)
    return (f"{{{{ range $i, $_ := {query} }}}}{{{{ if $i }}}};{{{{ end }}}} {item}"
            "{{ else }} none listed{{ end }}.")


def largest_outside_vllm(family: str, where: tuple[str, str]) -> str:
    """The largest series of `family` `where` outside vLLM as " (name, pid N)"; nothing without one."""
    return (f"{{{{ with {_query(f'topk(1, {family}{{}})', where, True)} }}}}{{{{ with . | first }}}} "
            "({{ .Labels.process }}, pid {{ .Labels.pid }}){{ end }}{{ end }}")


# One process of a query's results: "name (pid N) SIZE", or with its role "name (pid N, role) SIZE".
NAME_PID_SIZE = "{{ .Labels.process }} (pid {{ .Labels.pid }}) {{ .Value | humanize1024 }}B"
NAME_PID_ROLE_SIZE = "{{ .Labels.process }} (pid {{ .Labels.pid }}, {{ .Labels.role }}) {{ .Value | humanize1024 }}B"
HOST_RSS, GPU_MEMORY = "gpumem_process_host_rss_bytes", "gpumem_process_memory_used_bytes"

# The three processes outside vLLM that hold the most host memory on $labels.instance. On a
# unified-memory host the exporter exports the largest whatever they are.
HOST_PROCESSES_OUTSIDE_VLLM = process_list(HOST_RSS, ON_HOST, NAME_PID_SIZE, outside_vllm=True)

# The three processes with the most memory on the alert's GPU.
GPU_PROCESSES = process_list(GPU_MEMORY, ON_GPU, NAME_PID_ROLE_SIZE)

# What non-vLLM processes hold on the alert's GPU (the recording rule), as "SIZE" inside `{{ with }}`;
# `> 0` makes it absent at 0, for text that must not print "0B" where 0 says nothing.
OTHER_GPU_PROCESSES_QUERY = ('printf "instance_gpu:gpumem_other_process_memory:bytes{instance=%q,gpu=%q}" '
                             "$labels.instance $labels.gpu | query")
OTHER_GPU_PROCESSES_NONZERO_QUERY = (
    'printf "instance_gpu:gpumem_other_process_memory:bytes{instance=%q,gpu=%q} > 0" '
    "$labels.instance $labels.gpu | query")
