# gpu-memory-exporter: a small image, run with the host's PID namespace so NVML's PIDs resolve.
#   docker run -d --gpus all --pid host -p 9842:9842 gpu-memory-exporter
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY exporter ./exporter
# The exporter depends on the probe's distribution (its file schema): built from ./probe here.
COPY probe ./probe
RUN pip wheel --no-cache-dir --wheel-dir /wheels ./probe .

FROM python:3.11-slim
LABEL org.opencontainers.image.title="gpu-memory-exporter" \
      org.opencontainers.image.description="Prometheus exporter for GPU memory on LLM serving hosts" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home exporter
# NVML only needs the device nodes the NVIDIA runtime mounts; reading other processes' /proc
# entries (name, RSS, cgroup) needs the same user as them or CAP_SYS_PTRACE, so on most hosts
# the exporter runs as root: `--user 10001` works where all serving processes run as that user.
# The NVIDIA container runtime mounts libnvidia-ml.so.1 when these are set:
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=utility
EXPOSE 9842
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:9842/healthz', timeout=4).status != 200)"]
ENTRYPOINT ["gpu-memory-exporter"]
CMD ["run", "--listen", "0.0.0.0:9842"]
