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


def process_list(query: str, item: str) -> str:
    """The results of `query` (a template pipeline ending in `| query`), each as " `item`" (a
    template for one result, `.`), joined by ";" and ended with "." (" none listed." without any)."""
    return (f"{{{{ range $i, $_ := {query} }}}}{{{{ if $i }}}};{{{{ end }}}} {item}"
            "{{ else }} none listed{{ end }}.")


# One process of a query's results: "name (pid N) SIZE", or with its role "name (pid N, role) SIZE".
NAME_PID_SIZE = "{{ .Labels.process }} (pid {{ .Labels.pid }}) {{ .Value | humanize1024 }}B"
NAME_PID_ROLE_SIZE = "{{ .Labels.process }} (pid {{ .Labels.pid }}, {{ .Labels.role }}) {{ .Value | humanize1024 }}B"

# The three processes outside vLLM that hold the most host memory on $labels.instance. On a
# unified-memory host the exporter exports the largest whatever they are.
HOST_PROCESSES_OUTSIDE_VLLM = process_list(
    'printf "sort_desc(topk(3, gpumem_process_host_rss_bytes{instance=%q,role!=\\"vllm\\"}))" $labels.instance | query',
    NAME_PID_SIZE)

# The three processes with the most memory on the alert's GPU.
GPU_PROCESSES = process_list(
    'printf "sort_desc(topk(3, gpumem_process_memory_used_bytes{instance=%q,gpu=%q}))" $labels.instance $labels.gpu '
    "| query", NAME_PID_ROLE_SIZE)

# What non-vLLM processes hold on the alert's GPU (the recording rule), as "SIZE" inside `{{ with }}`;
# `> 0` makes it absent at 0, for text that must not print "0B" where 0 says nothing.
OTHER_GPU_PROCESSES_QUERY = ('printf "instance_gpu:gpumem_other_process_memory:bytes{instance=%q,gpu=%q}" '
                             "$labels.instance $labels.gpu | query")
OTHER_GPU_PROCESSES_NONZERO_QUERY = (
    'printf "instance_gpu:gpumem_other_process_memory:bytes{instance=%q,gpu=%q} > 0" '
    "$labels.instance $labels.gpu | query")
