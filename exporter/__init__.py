"""gpu-memory-exporter: Prometheus exporter and alerting daemon for GPU memory on LLM hosts."""
__version__ = "0.1.0"
