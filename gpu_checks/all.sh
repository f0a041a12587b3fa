#!/usr/bin/env bash
# Every check of gpu_checks/README.md in one call of about seven minutes, for a device lease of
# 15 minutes: real NVML beside nvidia-smi, the probe end to end, the leaker watched for what is
# left of the run, then the NVML source's cost. The leak finding itself needs about 20 minutes
# (README.md, step 3), more than such a lease holds: the watch records the real series and the
# growth rate instead.
# Run from the repository root. Wheels in .whl (pydantic, bcrypt, gpu-memory-probe, ...), where
# the machine lacks them, are installed first. Results: JSON and logs under $OUT.
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
RUN_SECONDS=${RUN_SECONDS:-330}
began=$(date +%s)
failed=""
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
timeout 60 python3 gpu_checks/real_gpu.py start || failed="$failed start"
timeout 60 python3 gpu_checks/real_gpu.py nvml || failed="$failed nvml"
timeout 240 python3 gpu_checks/real_gpu.py probe || failed="$failed probe"
left=$(( RUN_SECONDS - ($(date +%s) - began) ))
left=$(( left > 0 ? left : 0 ))
timeout $(( left + 60 )) python3 gpu_checks/real_gpu.py check --watch $left || failed="$failed check"
cp /tmp/gpumem-daemon.log "$OUT/" 2>/dev/null
timeout 30 python3 gpu_checks/real_gpu.py stop || failed="$failed stop"
# Last, with the leaker gone: the PyTorch processes it starts are then the GPU's only ones.
timeout 120 python3 gpu_checks/real_gpu.py nvml-cost || failed="$failed nvml-cost"
echo "failed:${failed:- none}"
[ -z "$failed" ]
