"""Classify out-of-memory messages and say what to change, with the numbers they carry.

Pure: no I/O. The parser (sources/oom_messages.py) reads what a message states; `classify`
decides what it means. A GPU allocation failure is classified by counterfactual
(docs/oom-diagnosis.md), with shortfall = requested - free:

- contention: memory held by other processes >= shortfall (freeing it would have made the
  allocation fit);
- fragmentation: else, PyTorch's reserved-but-unallocated memory >= shortfall (had the
  allocator been able to reuse its cache, it would have fit); also when the GPU had the free
  bytes and the allocation still failed;
- shortage: else; the load asks for more than the card has.

Two more: configuration (a cap or a server's start-up check refused the configuration before
the card ran out: the fix is a setting) and host (host RAM, not GPU memory).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..model import HOST_OOM_KINDS, OomEvent, OomMessage
from ..units import GiB, MiB, format_bytes

CLASSES = ("shortage", "fragmentation", "contention", "configuration", "host")

# An allocation that would leave the driver less than this fails even when "free" covers it:
# the driver hands out 2 MiB pages and keeps some for its own bookkeeping.
DRIVER_SLACK = 4 * MiB
# When a message lists no processes (PyTorch < 2.1, or no NVML in the container), memory on the
# GPU outside this process's PyTorch pool is this process's CUDA context, cuBLAS/cuDNN
# workspaces and NCCL buffers (together typically 0.3-1.5 GiB) plus other processes'. Only what
# exceeds this allowance is taken to be other processes'.
OWN_NON_TORCH_ALLOWANCE = 3 * GiB // 2
# No GPU has a petabyte: a request this large is a corrupted (overflowed) size.
ABSURD_REQUEST = 1 << 50
# Other processes holding this share of the GPU are worth a line of advice whatever the class.
NOTABLE_SHARE = 0.10


@dataclass
class _Verdict:
    klass: str
    verdict: str
    advice: list[str]
    shortfall: int | None = None
    causes: tuple[tuple[str, int], ...] = ()


def classify(message: OomMessage) -> OomEvent:
    """The message with its class, the counterfactual that decided it, and advice."""
    kind = message.kind
    if kind == "torch_cuda_oom":
        v = _allocation(message)
    elif kind == "vllm_insufficient_memory":
        v = _vllm_warmup(message) if message.batch is not None else _vllm_free(message)
    elif kind == "vllm_kv_cache_too_small":
        v = _vllm_kv_cache(message)
    elif kind == "sglang_kv_cache_too_small":
        v = _sglang_kv_cache()
    elif kind == "tgi_warmup_oom":
        v = _tgi_warmup(message)
    elif kind == "nccl_oom":
        v = _nccl(message)
    elif kind == "vllm_cpu_memory_check":
        v = _vllm_cpu(message)
    elif kind in HOST_OOM_KINDS:
        v = _host(message)
    else:  # cuda_runtime_oom and anything new
        v = _outside_allocator(message)
    parsed = {f.name: getattr(message, f.name) for f in fields(OomMessage)}
    return OomEvent(**parsed, klass=v.klass, verdict=v.verdict, shortfall_bytes=v.shortfall,
                    causes=v.causes, advice=tuple(v.advice))


# ------------------------------------------------------------------ helpers

def _floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100  # the epsilon keeps 0.47 from printing as 0.46


def _ceil2(x: float) -> float:
    return math.ceil(x * 100 - 1e-9) / 100


def _gpu(m: OomMessage) -> str:
    return f"GPU {m.gpu}" if m.gpu is not None else "the GPU"


def _alloc_conf(hint: str) -> str:
    """The allocator setting to suggest: the one PyTorch's own message names, if any."""
    if hint == "max_split_size_mb":
        return ("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 (this PyTorch predates"
                " expandable_segments)")
    return hint or "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def _others(m: OomMessage) -> tuple[int, str]:
    """Bytes held by other processes on the GPU, and how the verdict states them."""
    if m.processes_listed:
        if not m.other_processes:
            return 0, "none listed"
        listed = sum(b for _, b in m.other_processes)
        names = ", ".join(f"pid {pid}: {format_bytes(b)}"
                          for pid, b in sorted(m.other_processes, key=lambda p: -p[1])[:5])
        return listed, f"{format_bytes(listed)} ({names})"
    if m.total_bytes and m.free_bytes is not None and m.reserved_bytes is not None:
        outside = max(0, m.total_bytes - m.free_bytes - m.reserved_bytes)
        estimate = max(0, outside - OWN_NON_TORCH_ALLOWANCE)
        return estimate, (f"{format_bytes(estimate)} (no process list: {format_bytes(outside)} was"
                          " outside this process's PyTorch pool, less"
                          f" {format_bytes(OWN_NON_TORCH_ALLOWANCE)} for its own CUDA context and"
                          " libraries)")
    return 0, "not stated"


def _causes(*pairs: tuple[str, int | None]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(((name, b) for name, b in pairs if b), key=lambda p: -p[1]))


def _more_parallel(m: OomMessage) -> str:
    """The tensor-parallel advice for this server: a size above the one it already has."""
    tp = m.settings.tensor_parallel_size
    if tp is None:
        return "--tensor-parallel-size 2 or more"
    return f"--tensor-parallel-size {2 * tp} (it runs at {tp} now)"


def _smaller_footprint(m: OomMessage, what: str) -> str:
    """Quantisation and parallelism advice that leaves out what the server already does."""
    s = m.settings
    ways = []
    if not s.quantization:
        ways.append("quantise the weights (--quantization fp8/awq)")
    if s.backend != "cpu":
        ways.append(f"shard the model with {_more_parallel(m)}")
    if not ways:
        return ""
    text = " or ".join(ways)
    return f"{text[0].upper()}{text[1:]}{what}."


def _shortage_advice(m: OomMessage, shortfall: int | None) -> list[str]:
    advice = []
    if shortfall is not None and m.total_bytes and m.requested_bytes is not None:
        advice.append(
            f"Needed {format_bytes(m.requested_bytes)} with {format_bytes(m.free_bytes)} free of"
            f" {format_bytes(m.total_bytes)}: lower --gpu-memory-utilization by at least"
            f" {_ceil2(shortfall / m.total_bytes + 0.01):.2f} to leave {format_bytes(shortfall)}"
            " more headroom for activations.")
    advice.append("Lower --max-num-seqs or --max-num-batched-tokens to shrink the activation peak.")
    if footprint := _smaller_footprint(m, ""):
        advice.append(footprint)
    return advice


# ------------------------------------------------------------------ GPU allocations

def _allocation(m: OomMessage) -> _Verdict:
    """A PyTorch allocation that failed: the counterfactual over its numbers."""
    R, F, T, U = m.requested_bytes, m.free_bytes, m.total_bytes, m.reserved_unallocated_bytes
    gpu = _gpu(m)
    conf = _alloc_conf(m.allocator_hint)
    if R is not None and R >= ABSURD_REQUEST:
        return _Verdict("shortage", f"{format_bytes(R)} or more was requested: a corrupted size, not"
                        " a real demand.", ["A request that large is an overflowed size: look"
                                     " for the error before it (a failed collective, a timeout)."])
    if R is not None and T and R > T:
        return _Verdict(
            "shortage", f"{format_bytes(R)} was requested in one piece, more than all of {gpu}"
            f" ({format_bytes(T)}): no memory setting makes it fit.",
            [f"One allocation of {format_bytes(R)} is larger than all of {gpu} ({format_bytes(T)}):"
             " lower --max-model-len or the batch size; no memory setting helps."],
            shortfall=R - F if F is not None else None)
    if R is None or F is None:
        return _Verdict("shortage", "The message does not state both the request and the free"
                        " memory, so no cause can be weighed; taken as a shortage.",
                        _shortage_advice(m, None))
    used = m.reserved_bytes if m.reserved_bytes is not None else m.allocated_bytes
    cap = m.allowed_bytes
    if cap is not None and (T is None or cap < T) and (
            F >= R or (used is not None and used + R > cap)):
        return _Verdict(
            "configuration", f"The process is capped at {format_bytes(cap)} of {gpu}"
            f" and the {format_bytes(R)} request would pass the cap ({format_bytes(F)} was free on"
            " the GPU): raising the cap would have made it fit.",
            [f"The process is capped at {format_bytes(cap)} of {gpu}"
             " (torch.cuda.set_per_process_memory_fraction): raise the fraction or lower the load."])
    shortfall = R - F
    near_full = ""
    if shortfall <= 0:
        if F - R >= DRIVER_SLACK:
            others, _ = _others(m)
            advice = [f"{format_bytes(F)} was free yet {format_bytes(R)} could not be allocated in one"
                      f" piece: set {conf}.",
                      "If it recurs, check for a platform limit (unified-memory APUs, MIG, a"
                      " driver-side cap) and for Xid errors in dmesg."]
            if others and T and others >= NOTABLE_SHARE * T:
                advice.append(f"Other processes also hold {format_bytes(others)} of {gpu}.")
            return _Verdict(
                "fragmentation", f"{format_bytes(F)} was free for a {format_bytes(R)} request, yet the"
                " allocation failed: the bytes were there but not as one block the driver could"
                " give (fragmented device memory, or a platform limit). Nothing needed freeing.",
                advice, shortfall=shortfall, causes=_causes(("other_processes", others),
                                                            ("reserved_unallocated", U)))
        shortfall = DRIVER_SLACK - (F - R)
        near_full = (f" {format_bytes(F)} was free for {format_bytes(R)}, within the driver's"
                     f" {format_bytes(DRIVER_SLACK)} slack: the GPU was full.")
    others, others_said = _others(m)
    cache = U or 0
    head = (f"Shortfall {format_bytes(shortfall)} ({format_bytes(R)} requested,"
            f" {format_bytes(F)} free).{near_full} Held by other processes: {others_said}."
            f" Reserved by PyTorch but unallocated: {format_bytes(cache)}. ")
    causes = _causes(("other_processes", others), ("reserved_unallocated", cache),
                     ("allocated_by_pytorch", m.allocated_bytes))
    if others and others >= shortfall:
        return _contention(m, shortfall, others, head + "Other processes held at least the"
                           " shortfall: freeing it would have made the allocation fit, so this is"
                           " contention.", causes, conf)
    if cache and cache >= shortfall:
        advice = [f"{format_bytes(cache)} is reserved by PyTorch but unallocated, more than the"
                  f" {format_bytes(shortfall)} missing: set {conf}.",
                  "Restart the server to release the fragmented cache if it persists."]
        if others and T and others >= NOTABLE_SHARE * T:
            advice.append(f"Other processes also hold {format_bytes(others)} of {gpu}.")
        return _Verdict(
            "fragmentation", head + "Other processes held less than the shortfall, PyTorch's"
            " unallocated cache at least the shortfall: had the allocator been able to reuse it,"
            " the allocation would have fit, so this is fragmentation.", advice,
            shortfall=shortfall, causes=causes)
    return _Verdict(
        "shortage", head + f"Neither covers the shortfall: the load needs more than {gpu} has, so"
        " this is a shortage.", _shortage_advice(m, shortfall), shortfall=shortfall, causes=causes)


def _contention(m: OomMessage, shortfall: int, others: int, verdict: str,
                causes: tuple[tuple[str, int], ...], conf: str) -> _Verdict:
    T, gpu = m.total_bytes, _gpu(m)
    advice = []
    if m.processes_listed:
        names = ", ".join(f"pid {pid} ({format_bytes(b)})" for pid, b in
                          sorted(m.other_processes, key=lambda p: -p[1])[:5])
        share = f" ({others / T:.0%})" if T else ""
        advice.append(f"Other processes hold {format_bytes(others)}{share} of {gpu}: {names};"
                      f" freeing {format_bytes(shortfall)} of it is enough. Stop them or move them"
                      " to another GPU.")
    else:
        outside = (T or 0) - (m.free_bytes or 0) - (m.reserved_bytes or 0)
        advice.append(f"{format_bytes(outside)} of {gpu} is held outside this process's PyTorch"
                      " pool (other processes or stale memory): check nvidia-smi and stop them;"
                      f" {format_bytes(shortfall)} would have been enough.")
    if T:
        share_left = _floor2((T - others) / T - 0.02)
        if share_left > 0:
            advice.append(f"Or lower --gpu-memory-utilization to {share_left:.2f} or below so vLLM"
                          " fits beside them.")
    cache = m.reserved_unallocated_bytes or 0
    if cache >= shortfall:
        advice.append(f"PyTorch's {format_bytes(cache)} of unallocated cache would also have"
                      f" covered it: set {conf}.")
    return _Verdict("contention", verdict, advice, shortfall=shortfall, causes=causes)


def _outside_allocator(m: OomMessage) -> _Verdict:
    if "CUBLAS_STATUS_ALLOC_FAILED" in m.message:
        first = "cuBLAS could not allocate its workspace: the GPU is full outside PyTorch's pool."
    else:
        first = ("A CUDA call outside PyTorch's allocator (context, library workspace, custom"
                 " kernel) ran out of memory.")
    return _Verdict(
        "shortage", "A CUDA call outside PyTorch's allocator failed; the message states no"
        " numbers, so the memory outside vLLM's pool is taken to be too small.",
        [first + " Lower --gpu-memory-utilization by 0.05 to leave headroom.",
         "Check nvidia-smi for other processes or memory left by a crashed server."])


def _nccl(m: OomMessage) -> _Verdict:
    req = m.requested_bytes
    first = (f"NCCL could not allocate {format_bytes(req)} for its buffers: " if req is not None
             else "NCCL ran out of GPU memory for its buffers: ")
    return _Verdict(
        "shortage", "NCCL allocates its buffers outside PyTorch's pool; they did not fit in what"
        " the pool left free.",
        [first + "lower --gpu-memory-utilization by 0.03-0.05 to leave room outside vLLM's pool.",
         "With tensor parallelism set NCCL_CUMEM_ENABLE=0, or a smaller NCCL_BUFFSIZE."])


# ------------------------------------------------------------------ servers' start-up checks

def _vllm_free(m: OomMessage) -> _Verdict:
    """vLLM's start-up check: free memory below gpu_memory_utilization x total."""
    F, T, desired, util = m.free_bytes, m.total_bytes, m.requested_bytes, m.gpu_memory_utilization
    gpu = _gpu(m)
    if F is None or not T or desired is None:
        return _Verdict(
            "contention", "vLLM found less free memory at start-up than its budget; the check can"
            " only fail when something else holds memory (numbers not stated).",
            ["Lower --gpu-memory-utilization, or stop the other processes using this GPU"
             " (nvidia-smi)."])
    used, shortfall = T - F, desired - F
    suggestion = max(0.0, _floor2(F / T - 0.01))  # a utilisation that fits what was free
    cur = f" from {util:g}" if util is not None else ""
    lower = (f"lower --gpu-memory-utilization{cur} to {suggestion:.2f} or below"
             f" ({format_bytes(F)} of {format_bytes(T)} was free at start-up).")
    stop = (f"stop what else holds {format_bytes(used)} on {gpu} (nvidia-smi), e.g. a previous"
            " vLLM that did not exit.")
    if suggestion >= 0.05:
        advice = ["Lower " + lower[len("lower "):], "Or " + stop]
    else:  # almost nothing is free: only freeing the GPU helps
        advice = ["Stop " + stop[len("stop "):], "Then, if it must share the GPU, " + lower]
    head = (f"vLLM wanted {format_bytes(desired)}"
            f"{f' ({util:g} of {format_bytes(T)})' if util is not None else ''} with"
            f" {format_bytes(F)} free: {format_bytes(shortfall)} short. ")
    causes = (("in_use_at_start", used),) if used > 0 else ()
    if used >= shortfall:
        return _Verdict(
            "contention", head + f"{format_bytes(used)} was in use at start-up (other processes;"
            " vLLM's own CUDA context is a few hundred MiB of it), at least the shortfall:"
            " freeing it would have let vLLM start, so this is contention.", advice,
            shortfall=shortfall, causes=causes)
    return _Verdict(
        "shortage", head + f"Even an empty {gpu} would not hold the budget: the configuration asks"
        " for more than the card has.", advice, shortfall=shortfall, causes=causes)


def _vllm_warmup(m: OomMessage) -> _Verdict:
    seqs = m.batch or 1
    return _Verdict(
        "configuration", f"vLLM ran out of memory warming up with {seqs} dummy requests"
        " (max_num_seqs): the configured batch does not fit beside the KV cache.",
        [f"vLLM ran out of memory warming up with {seqs} requests: lower --max-num-seqs to"
         f" {max(1, seqs // 2)}.",
         "Or lower --gpu-memory-utilization by 0.05 to leave room for the sampler's peak."])


def _kv_cache_knob(m: OomMessage, needed: int | None, short: int | None, approx: bool = False) -> str:
    """How to give the KV cache more memory on this server: the setting that sizes it. With an
    explicit KV size --gpu-memory-utilization sizes nothing, so it is never the advice then."""
    s = m.settings
    if s.explicit_kv_cache:
        target = f" to {'about' if approx else 'at least'} {format_bytes(needed)}" if needed else ""
        if s.kv_cache_memory_bytes is not None:
            return (f"raise --kv-cache-memory-bytes (now {format_bytes(s.kv_cache_memory_bytes)}){target},"
                    " if the memory is there")
        gib = f" to {'about' if approx else 'at least'} {math.ceil(needed / GiB)} (GiB)" if needed else ""
        return (f"raise VLLM_CPU_KVCACHE_SPACE{gib}, or set --kv-cache-memory-bytes{target},"
                " if the memory node has it")
    util = s.gpu_memory_utilization if s.gpu_memory_utilization is not None else m.gpu_memory_utilization
    now = f" (now {util:g})" if util is not None else ""
    more = f" to give the KV cache {format_bytes(short)} more" if short else ""
    where = " of the memory node" if s.backend == "cpu" else ""
    return f"raise --gpu-memory-utilization{now}{more}{where}, if there is room"


def _kv_dtype(m: OomMessage) -> str:
    dtype = (m.settings.kv_cache_dtype or "").lower()
    return "" if dtype.startswith("fp8") else "--kv-cache-dtype fp8"


def _vllm_kv_cache(m: OomMessage) -> _Verdict:
    max_len, fits = m.max_model_len, m.max_model_len_fits
    needed, available = m.requested_bytes, m.free_bytes
    if max_len is None:  # "No available memory for the cache blocks"
        return _Verdict(
            "configuration", "Weights and the activation peak already fill vLLM's budget: no"
            " memory is left for the KV cache.",
            [f"Weights and activation peak already use the whole memory budget: {_kv_cache_knob(m, None, None)}.",
             "Lower --max-num-batched-tokens / --max-num-seqs"
             + (f"; {footprint[0].lower()}{footprint[1:]}" if (footprint := _smaller_footprint(m, "")) else ".")])
    others = ", ".join(x for x in (_kv_dtype(m), "" if m.settings.backend == "cpu" else _more_parallel(m)) if x)
    if needed is None:
        # Counted in tokens (vLLM < 0.8), or in GiB too small to print (vLLM prints sizes below
        # 0.005 GiB as 0.0): the tokens are the numbers there are.
        have = f" ({format_bytes(available)})" if available else ""
        verdict = (f"The KV cache{have} holds one request of at most {fits} tokens, fewer than"
                   f" --max-model-len {max_len}: the configuration asks for more than the budget holds.")
        if m.requested_bytes is None and m.free_bytes is None and fits:
            verdict += " vLLM stated the sizes only as 0.0 GiB, so the bytes are unknown."
        estimate = available * max_len // fits if available and fits else None
        advice = []
        if fits:
            advice.append(f"The KV cache holds {fits} tokens but --max-model-len is {max_len}:"
                          f" set --max-model-len {fits} or lower.")
        knob = _kv_cache_knob(m, estimate, None, approx=True)
        advice.append(f"Or {knob}" + (f" (about {format_bytes(estimate)} holds {max_len} tokens at the"
                                      f" {format_bytes(available)} per {fits} tokens it has now)"
                                      if estimate and not m.settings.explicit_kv_cache else "")
                      + (f"; or use {others}" if others else "") + ".")
        return _Verdict("configuration", verdict, advice)
    short = max(0, needed - (available or 0))
    verdict = (f"--max-model-len {max_len} needs {format_bytes(needed)} of KV cache,"
               f" {format_bytes(available)} is available: {format_bytes(short)} short. The"
               " configuration asks for more than the budget holds.")
    advice = []
    if fits:
        advice.append(f"--max-model-len {max_len} needs {format_bytes(needed)} of KV cache but"
                      f" {format_bytes(available)} is available: set --max-model-len {fits} or lower.")
    advice.append(f"Or {_kv_cache_knob(m, needed, short)}" + (f"; or use {others}" if others else "") + ".")
    return _Verdict("configuration", verdict, advice, shortfall=short)


def _sglang_kv_cache() -> _Verdict:
    return _Verdict(
        "configuration", "SGLang's static pool (--mem-fraction-static of the GPU) has no room for a"
        " KV cache after the weights.",
        ["Raise --mem-fraction-static (by 0.05 at a time): SGLang sizes weights plus KV cache as"
         " that fraction of the GPU, so a larger fraction leaves the KV cache room.",
         "Or quantise the weights or add --tp to spread them."])


def _tgi_warmup(m: OomMessage) -> _Verdict:
    tokens = m.batch or 0
    return _Verdict(
        "configuration", f"TGI's warm-up could not run a batch of {tokens} tokens: the configured"
        " batch does not fit beside the weights.",
        [f"Lower --max-batch-prefill-tokens below {tokens} (try {max(1, tokens // 2)}), and"
         " --max-batch-total-tokens with it.",
         "Or quantise the weights (--quantize) or shard the model (--num-shard)."])


def _vllm_cpu(m: OomMessage) -> _Verdict:
    """vLLM's CPU backend refused to start: its memory node had less available than it wanted.
    The counterfactual on host memory: what the rest of the node held against what was missing."""
    F, T, want, node = m.free_bytes, m.total_bytes, m.requested_bytes, m.memory_node
    where = f"memory node {node}" if node is not None else "the memory node"
    s = m.settings
    used = T - F if T is not None and F is not None else None
    said = (f"{format_bytes(F)} of {format_bytes(T)} available on {where}" if used is not None
            else f"less available on {where} than it wanted")
    # The explicit size's check runs before vLLM logs the size: the flag, when the log shows it
    # given, else the legacy variable (vLLM turns it into the flag).
    flag = ("--kv-cache-memory-bytes" if s.kv_cache_memory_bytes is not None
            else "VLLM_CPU_KVCACHE_SPACE (in GiB) or --kv-cache-memory-bytes")
    if m.gpu_memory_utilization is not None:  # at start-up, sized by the utilisation
        util = m.gpu_memory_utilization
        head = (f"The CPU backend wanted --gpu-memory-utilization {util:g} of {where} ({format_bytes(want)})"
                f" with {said}. ")
        explicit = ("Give the KV cache an explicit size (--kv-cache-memory-bytes, or VLLM_CPU_KVCACHE_SPACE"
                    " in GiB): the CPU backend then skips this check and --gpu-memory-utilization sizes nothing.")
        fits = _floor2(F / T - 0.01) if F is not None and T else None
        lower = (f"Or lower --gpu-memory-utilization from {util:g} to {fits:.2f} or below"
                 f" (the share of {where} that was available)." if fits and fits >= 0.05 else "")
        if util >= 0.99 or (want is not None and T is not None and want >= T):
            return _Verdict(
                "configuration", head + f"That is all of {where}: the system and vLLM's own API server"
                " and engine core always hold some of it, so no machine passes this check.",
                [explicit] + ([lower] if lower else []))
        return _Verdict(
            "contention", head + (f"{format_bytes(used)} was in use on {where} (other processes, the"
                                  " page cache it cannot reclaim, vLLM's own API server and engine core),"
                                  " at least the shortfall: freeing it would have let vLLM start, so this is"
                                  " contention." if used is not None else ""),
            [explicit] + ([lower] if lower else []) + [f"Or stop what holds memory on {where}."],
            shortfall=want - F if want is not None and F is not None else None,
            causes=(("in_use_at_start", used),) if used else ())
    if m.allowed_bytes is not None:  # an automatic size: utilisation x node, less the worker's own use
        own = f" the worker already held {format_bytes(m.process_bytes)}" if m.process_bytes else ""
        if want is None:
            return _Verdict(
                "configuration", f"The worker may use {format_bytes(m.allowed_bytes)} of {where}"
                f" (--gpu-memory-utilization) and{own or ' already used it all'}: nothing is left for"
                " the KV cache.",
                ["Give the KV cache an explicit size (--kv-cache-memory-bytes, or VLLM_CPU_KVCACHE_SPACE in"
                 " GiB), or raise --gpu-memory-utilization."])
        return _Verdict(
            "contention", f"The CPU backend wanted {format_bytes(want)} for the KV cache with {said}:"
            " other processes on the node hold what was missing, so this is contention.",
            [f"Stop what holds memory on {where}, or lower --gpu-memory-utilization.",
             "Or give the KV cache an explicit size that fits (--kv-cache-memory-bytes)."],
            shortfall=want - F if F is not None else None,
            causes=(("in_use_at_start", used),) if used else ())
    # An explicit KV size.
    fits_now = f" at most {format_bytes(F)}" if F else " less"
    if want is not None and T is not None and want > T:
        return _Verdict(
            "configuration", f"The KV cache was set to {format_bytes(want)}, more than all of {where}"
            f" ({format_bytes(T)}): no machine like this one holds it.",
            [f"Set {flag} to{fits_now} (what {where} had available), and lower --max-model-len or"
             " --max-num-seqs if that is too small for them."])
    return _Verdict(
        "contention", f"The KV cache was set to {format_bytes(want)} with {said}: "
        + (f"{format_bytes(used)} was in use on the node, at least the shortfall; freeing it would have"
           " let vLLM start, so this is contention." if used is not None else "other processes hold the rest."),
        [f"Stop what holds memory on {where}, or set {flag} to{fits_now}."],
        shortfall=want - F if want is not None and F is not None else None,
        causes=(("in_use_at_start", used),) if used else ())


# ------------------------------------------------------------------ host memory

def _host(m: OomMessage) -> _Verdict:
    if m.victim_pid is not None:
        who = f"pid {m.victim_pid} ({m.victim_name})" if m.victim_name else f"pid {m.victim_pid}"
    else:
        who = m.victim_name or "a process"
    rss = m.process_bytes
    held = f" holding {format_bytes(rss)} of host memory" if rss is not None else ""
    causes = (("victim_resident", rss),) if rss else ()
    if m.kind == "cgroup_oom":
        where = f" ({m.memory_limit})" if m.memory_limit else ""
        advice = [f"The memory cgroup limit{where} was hit and {who} was killed{held}:"
                  " raise the container memory limit.",
                  "Or cut vLLM's host memory: smaller --swap-space / --cpu-offload-gb, fewer"
                  " API server processes."]
        verdict = "A container's memory limit was reached: host RAM, not GPU memory."
    elif m.kind == "container_oom_killed":
        advice = ["The container was OOM-killed at its memory limit: raise"
                  " resources.limits.memory (or docker --memory).",
                  "Or cut vLLM's host memory: smaller --swap-space / --cpu-offload-gb."]
        verdict = "The container runtime reports an OOM kill: host RAM, not GPU memory."
    elif m.kind == "ray_oom_kill":
        node = (f" with the node at {format_bytes(m.total_bytes - m.free_bytes)} of"
                f" {format_bytes(m.total_bytes)}" if m.total_bytes and m.free_bytes is not None
                else "")
        limit = f" ({m.memory_limit})" if m.memory_limit else ""
        advice = [f"Ray's memory monitor killed {who}{held}{node}{limit}: give the node more RAM"
                  " or run fewer workers on it.",
                  "Or raise RAY_memory_usage_threshold if the node can take it."]
        verdict = "Ray's memory monitor killed a worker: host RAM, not GPU memory."
    elif m.kind == "host_memory_error" and (m.settings.backend == "cpu" or (
            m.requested_bytes is not None and m.requested_bytes == m.settings.kv_cache_memory_bytes)):
        # vLLM's CPU backend keeps the model and the KV cache in host memory.
        size = m.requested_bytes
        kv = m.settings.kv_cache_memory_bytes
        what = f" {format_bytes(size)}" if size is not None else ""
        advice = []
        if kv is not None and size is not None and size >= kv:
            advice.append(f"The worker could not allocate the{what} KV cache that --kv-cache-memory-bytes"
                          f" ({format_bytes(kv)}) asks for: lower it, or give the server that much more"
                          " memory (a container or cgroup limit, ulimit -v, other processes on the host).")
        else:
            advice.append(f"vLLM's CPU backend could not allocate{what} of host memory: free host memory"
                          " or raise the server's memory limit (container, cgroup, ulimit -v).")
        advice.append("Lower --max-num-seqs or --max-model-len to need less memory per step.")
        verdict = ("A host allocation failed in vLLM's CPU backend, where the model and its KV cache"
                   " live in host memory.")
    elif m.kind == "host_memory_error":
        what = (f" allocating {format_bytes(m.requested_bytes)}"
                if m.requested_bytes is not None else "")
        advice = [f"Host RAM ran out in the Python process{what} (not GPU memory).",
                  "Cap prompt size (--max-model-len) and concurrent requests, or raise the"
                  " container memory limit."]
        verdict = "A host allocation failed in the server process: host RAM, not GPU memory."
    else:
        advice = [f"The host ran out of RAM and the kernel killed {who}{held}.",
                  "Cut host memory use (smaller --swap-space / --cpu-offload-gb, fewer"
                  " workers) or stop other memory-hungry processes on the host."]
        verdict = "The kernel's OOM killer ran: host RAM, not GPU memory."
    return _Verdict("host", verdict, advice, causes=causes)
