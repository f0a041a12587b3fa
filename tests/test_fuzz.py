"""Property tests on the parsers of outside input that had none: the config (as a dict and as YAML
text), the web config, and the trace readers (CSV and Prometheus JSON). Whatever the input, the
only exception is the documented one. (Metrics text and OOM log lines: tests/test_vllm_normalise.py
and tests/test_oom_parse.py.)"""
from __future__ import annotations

import json
import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.config import Config, ConfigError, build, load
from exporter.postmortem.trace import TraceError, read_rows
from exporter.serve.webconfig import WebConfig, load_web_config

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
# Values shaped like the real keys, so the search gets past the first "unknown key".
CONFIG_KEYS = ["listen", "interval_seconds", "web_config_file", "stale_after_seconds", "history", "gpu", "nvml",
               "host", "logs", "vllm", "admission", "raw_seconds", "retention_seconds", "proc_root",
               "read_cmdline", "files", "endpoints", "url", "name", "bearer_token_file", "timeout_seconds",
               "max_response_bytes", "process_pattern", "close_above", "open_below", "retry_max_seconds"]
keys = st.one_of(st.sampled_from(CONFIG_KEYS), st.text(max_size=8), st.integers(), st.booleans())
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(keys, inner, max_size=5)),
                      max_leaves=20)
documents = st.dictionaries(keys, values, max_size=6)


def write(text: str | bytes) -> str:
    fd, path = tempfile.mkstemp()
    with os.fdopen(fd, "wb") as fh:
        fh.write(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    return path


@SETTINGS
@given(documents)
def test_config_build_from_any_mapping_raises_only_config_error(doc):
    try:
        config = build(doc)
    except ConfigError as exc:
        assert str(exc)  # a message naming the problem, never empty
        return
    assert isinstance(config, Config) and config.interval_seconds > 0


yaml_text = st.one_of(
    st.text(max_size=200),
    st.builds(lambda d: json.dumps(d, default=str), documents),  # JSON is YAML
    st.lists(st.sampled_from(["listen: ", "vllm:\n  endpoints:\n", "  - url: ", "history: {", "&a [*a]",
                              "!!python/object:os.system", "\t", "0.0.0.0:1", "- ", ": ", "\n", "'", "%YAML 1.1\n",
                              "interval_seconds: 1e999\n", "\x00", "\udcff"]), max_size=12).map("".join),
)


@SETTINGS
@given(yaml_text)
def test_config_load_of_any_text_raises_only_config_error(text):
    path = write(text)
    try:
        load(path)
    except ConfigError:
        pass
    finally:
        os.unlink(path)


TLS_KEYS = ["cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version", "cipher"]
web_docs = st.dictionaries(
    st.sampled_from(["tls_server_config", "basic_auth_users", "http_server_config", "other"]),
    st.one_of(values, st.dictionaries(st.sampled_from(TLS_KEYS), st.one_of(scalars, st.sampled_from(
        ["/nonexistent", "TLS12", "TLS13", "RequireAndVerifyClientCert", "NoClientCert", "$2y$10$abc"])),
        max_size=4),
        st.dictionaries(st.text(max_size=6), st.one_of(scalars, st.just("$2b$04$" + "a" * 53)), max_size=3)),
    max_size=3)


@SETTINGS
@given(st.one_of(web_docs.map(lambda d: json.dumps(d, default=str)), yaml_text))
def test_web_config_of_any_text_raises_only_config_error(text):
    path = write(text)
    try:
        cfg = load_web_config(path)
    except ConfigError:
        return
    finally:
        os.unlink(path)
    assert isinstance(cfg, WebConfig)
    assert all(h.startswith(("$2a$", "$2b$", "$2y$")) for h in cfg.basic_auth_users.values())


CSV_HEADER = "timestamp,gpu,pid,process,used_bytes"
cells = st.one_of(st.sampled_from(["", "0", "1", "-1", "1.5", "nan", "inf", "1e400", "0/1", "vllm", "\"a,b\"",
                                   "\"", "99999999999999999999999", "1700000000", "GPU-x", "true"]),
                  st.text(max_size=6))
csv_text = st.builds(
    lambda header, rows: "\n".join([header] + [",".join(r) for r in rows]),
    st.one_of(st.just(CSV_HEADER), st.just(CSV_HEADER + ",total_bytes,host_rss_bytes,role"), st.text(max_size=40)),
    st.lists(st.lists(cells, min_size=0, max_size=9), max_size=8))
prom_json = st.one_of(
    st.builds(lambda result: json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}),
              st.lists(st.fixed_dictionaries({
                  "metric": st.dictionaries(st.sampled_from(["__name__", "gpu", "pid", "process", "uuid"]),
                                            st.one_of(st.sampled_from(["gpumem_gpu_memory_used_bytes",
                                                                       "gpumem_process_memory_used_bytes", "0", "7"]),
                                                      st.text(max_size=5)), max_size=5),
                  "values": st.lists(st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=5)),
                                              max_size=3), max_size=4)}), max_size=3)),
    st.builds(lambda v: json.dumps(v, default=str), values),
)


@SETTINGS
@given(st.one_of(csv_text, prom_json, st.binary(max_size=200)), st.sampled_from([".csv", ".json", ""]))
def test_trace_readers_raise_only_trace_error(text, suffix):
    fd, path = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as fh:
        fh.write(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        rows = read_rows(path)
    except TraceError as exc:
        assert str(exc)
        return
    finally:
        os.unlink(path)
    assert isinstance(rows, list)
