import pytest
import yaml
from click.testing import CliRunner
from pydantic import TypeAdapter

from exporter.cli import main
from exporter.config import ConfigError, build, load, parse_listen
from exporter.config.fields import Size

parse_size = TypeAdapter(Size).validate_python


def write(tmp_path, data):
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def test_defaults_are_valid():
    config = build()
    assert config.interval_seconds == 5.0
    assert config.host.read_cmdline is False
    assert config.effective_stale_after == 15.0


def test_healthz_allows_a_tick_that_waits_for_a_hung_server(tmp_path):
    """The CPU recipe's --interval 1 with a 10 s timeout: /healthz said 503 while a tick waited for a
    frozen server, though the exporter was sampling as designed."""
    config = load(write(tmp_path, {"interval_seconds": 1, "vllm": {"endpoints": [
        {"url": "http://127.0.0.1:8000/metrics", "timeout_seconds": 10}, "http://127.0.0.1:8001/metrics"]}}))
    assert config.effective_stale_after == 12.0
    assert load(write(tmp_path, {"interval_seconds": 1, "stale_after_seconds": 4})).effective_stale_after == 4.0


def test_file_sections_map_onto_fields(tmp_path):
    config = load(write(tmp_path, {
        "listen": "127.0.0.1:9999", "interval_seconds": 2,
        "history": {"raw_seconds": 1800, "retention_seconds": 7200},
        "host": {"read_cmdline": True},
        "logs": {"files": ["/var/log/vllm.log"]},
        "admission": {"close_above": 0.95, "open_below": 0.7},
        "vllm": {"endpoints": ["http://127.0.0.1:8000/metrics",
                               {"url": "http://127.0.0.1:8001/metrics", "name": "b",
                                "max_response_bytes": "1MiB", "timeout_seconds": 0.5}]},
    }))
    assert config.listen == "127.0.0.1:9999"
    assert config.interval_seconds == 2.0
    assert config.history.raw_seconds == 1800
    assert config.host.read_cmdline is True
    assert config.logs.files == ("/var/log/vllm.log",)
    assert config.admission.close_above == 0.95
    assert [e.url for e in config.vllm.endpoints] == ["http://127.0.0.1:8000/metrics",
                                                      "http://127.0.0.1:8001/metrics"]
    assert config.vllm.endpoints[1].max_response_bytes == 1 << 20


def test_overrides_beat_the_file(tmp_path):
    config = load(write(tmp_path, {"interval_seconds": 2}), {"interval_seconds": 7.0, "listen": None})
    assert config.interval_seconds == 7.0


@pytest.mark.parametrize("data, message", [
    ({"intervall_seconds": 5}, "intervall_seconds: unknown key (did you mean 'interval_seconds'?)"),
    ({"history": {"raw": 5}}, "history.raw: unknown key"),
    ({"interval_seconds": "fast"}, "interval_seconds: expected a finite number"),
    ({"interval_seconds": 0}, "interval_seconds: must be positive"),
    ({"interval_seconds": float("nan")}, "interval_seconds: expected a finite number"),
    ({"stale_after_seconds": -5}, "stale_after_seconds: must not be negative"),
    ({"gpu": {"retry_max_seconds": 0}}, "gpu.retry_max_seconds: must be positive"),
    ({"nvml": {"retry_max_seconds": 0}}, "nvml.retry_max_seconds: must be positive"),  # the old name, as written
    ({"gpu": {"backend": "voodoo"}}, "gpu.backend: expected one of nvml, none, got 'voodoo'"),
    ({"nvml": {}, "gpu": {}}, "nvml: the old name of gpu; give gpu only"),
    ({"vllm": {"endpoints": [{"url": "http://x:1/m", "max_response_bytes": "9" * 400}]}},
     "vllm.endpoints[0].max_response_bytes: '" + "9" * 64 + "' is too large"),
    ({"vllm": {"endpoints": [{"url": "http://x:1/m", "max_response_bytes": "1e300"}]}},
     "vllm.endpoints[0].max_response_bytes: expected a size"),
    ({"host": {"read_cmdline": "yes"}}, "host.read_cmdline: expected true or false"),
    ({"listen": "nowhere"}, "listen: expected HOST:PORT"),
    ({"vllm": {"endpoints": [{"name": "x"}]}}, "vllm.endpoints[0]: missing required key url"),
    ({"vllm": {"endpoints": [{"url": "ftp://x"}]}}, "vllm.endpoints[0].url: expected http(s)://"),
    ({"vllm": {"endpoints": [{"url": "http://x:1/m", "timeout": 1}]}},
     "vllm.endpoints[0].timeout: unknown key (did you mean 'timeout_seconds'?)"),
    ({"vllm": {"endpoints": [{"url": "http://x:1/m", "max_response_bytes": "lots"}]}},
     "vllm.endpoints[0].max_response_bytes: expected a size"),
    ({"vllm": {"endpoints": [{"url": "http://x:1/m", "process_pattern": "("}]}},
     "vllm.endpoints[0].process_pattern: not a valid regex"),
    ({"vllm": {"endpoints": ["http://x:1/metrics?a=1", {"url": "http://x:1/metrics?a=2"}]}},
     "vllm.endpoints[1]: its `endpoint` label 'http://x:1/metrics' is endpoints[0]'s too (the URLs differ in "
     "their query, which the label leaves out): give each a distinct `name`"),
    ({"vllm": {"endpoints": [{"url": "http://x:1/m", "name": "a"}, {"url": "http://x:2/m", "name": "a"}]}},
     "vllm.endpoints[1]: its `endpoint` label 'a' is endpoints[0]'s too (both are named so)"),
    # Two URLs apart only in the fragment, never sent, are one page: the query is not to blame.
    ({"vllm": {"endpoints": ["http://h:8000/metrics?t=1#a", "http://h:8000/metrics?t=1#b"]}},
     "vllm.endpoints[1]: reads the page endpoints[0] reads (the URLs differ only in the fragment (after #), "
     "which is never sent): list it once"),
    ({"vllm": {"endpoints": ["http://h:8000/metrics", "http://h:8000/metrics"]}},
     "vllm.endpoints[1]: reads the page endpoints[0] reads (the same URL): list it once"),
    # One page under two names is still one server, counted twice (the trial of 5d3e341).
    ({"vllm": {"endpoints": [{"url": "http://h:8000/metrics#a", "name": "a"},
                             {"url": "http://h:8000/metrics#b", "name": "b"}]}},
     "vllm.endpoints[1]: reads the page endpoints[0] reads (the URLs differ only in the fragment"),
    ({"vllm": {"endpoints": [{"url": "http://h:8000", "name": "a"}, {"url": "HTTP://H:8000/metrics", "name": "b"}]}},
     "vllm.endpoints[1]: reads the page endpoints[0] reads (the same scheme, host, port, path and query"),
    ({"vllm": {"endpoints": [{"url": "http://127.0.0.1:8000/", "name": "a"},
                             {"url": "http://127.0.0.1:8000/metrics", "name": "b"}]}},
     "vllm.endpoints[1]: reads the page endpoints[0] reads"),
    ({"vllm": {"endpoints": ["http://u:p@h:8000/metrics#a", "http://h:8000/metrics#b"]}},
     "(the URLs differ in their user or password, which the label leaves out)"),
    ({"admission": {"close_above": 0.7, "open_below": 0.8}}, "admission: need 0 < open_below < close_above"),
    ({"history": {"raw_seconds": 9000, "retention_seconds": 60}}, "history.raw_seconds: must not exceed"),
    ({"logs": {"files": "one.log"}}, "logs.files: expected a list"),
    ("- a list\n", "the top level must be a mapping"),
    ("key: [unclosed\n", "not valid YAML"),
])
def test_errors_name_the_key_and_the_problem(tmp_path, data, message):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, data))
    assert message in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load(str(tmp_path / "absent.yml"))


def test_oversized_file_is_refused(tmp_path):
    path = tmp_path / "big.yml"
    path.write_text("# " + "x" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than"):
        load(str(path))


@pytest.mark.parametrize("text, expected", [("8MiB", 8 << 20), ("1.5GiB", 3 << 29), (1024, 1024),
                                            ("10 kb", 10_000), ("512", 512)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, expected", [("0.0.0.0:9842", ("0.0.0.0", 9842)), (":80", ("0.0.0.0", 80)),
                                            ("[::1]:9000", ("::1", 9000))])
def test_listen(text, expected):
    assert parse_listen(text) == expected


def test_listen_rejects_bad_port():
    with pytest.raises(ConfigError):
        parse_listen("host:99999")


def test_the_nvml_section_is_read_as_gpu_with_a_warning_and_printed_with_its_new_name(tmp_path, caplog):
    """`nvml:` was the GPU library's section before a second vendor could be one (#20)."""
    path = write(tmp_path, {"nvml": {"retry_initial_seconds": 2, "retry_max_seconds": 60}})
    with caplog.at_level("WARNING", logger="exporter.config"):
        config = load(path)
    assert (config.gpu.backend, config.gpu.retry_initial_seconds, config.gpu.retry_max_seconds) == ("nvml", 2, 60)
    assert any("'nvml' is deprecated" in r.getMessage() and "'gpu'" in r.getMessage() for r in caplog.records)
    result = CliRunner().invoke(main, ["check-config", path])
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert "nvml" not in printed and printed["gpu"]["retry_max_seconds"] == 60


def test_check_config_reports_duplicate_keys_with_every_other_problem(tmp_path):
    """A key given twice is one problem among the others, each with its key path (#19 item 5):
    the README promises every problem at once."""
    path = write(tmp_path, "listen: 0.0.0.0:9842\ninterval_seconds: -1\nlisten: 127.0.0.1:9000\n"
                           "vllm:\n  endpoints:\n    - url: http://a:1/metrics\n      url: http://b:1/metrics\n"
                           "      nme: x\n")
    result = CliRunner().invoke(main, ["check-config", path])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert any(line.strip().startswith("listen: given twice") and "config.yml:3:1" in line for line in lines)
    assert any(line.strip().startswith("vllm.endpoints[0].url: given twice") for line in lines)
    assert any(line.strip().startswith("interval_seconds: must be positive") for line in lines)
    assert any("vllm.endpoints[0].nme: unknown key" in line for line in lines)
    with pytest.raises(ConfigError) as err:  # run and a reload read the file the same way
        load(path)
    assert len(err.value.problems) == 4


def test_check_config_takes_the_file_as_config_like_run_or_as_file_but_not_both(tmp_path):
    """`run --config FILE` and `check-config FILE` named the same file two ways; check-config
    takes either spelling, with the same answer, and refuses being given it twice."""
    good = write(tmp_path, {"interval_seconds": 2})
    positional = CliRunner().invoke(main, ["check-config", good])
    as_option = CliRunner().invoke(main, ["check-config", "--config", good])
    assert positional.exit_code == as_option.exit_code == 0, (positional.output, as_option.output)
    assert as_option.stdout == positional.stdout and "interval_seconds: 2" in as_option.stdout
    bad = tmp_path / "bad.yml"
    bad.write_text("interval_secs: 2\n")
    refused = CliRunner().invoke(main, ["check-config", "--config", str(bad)])
    assert refused.exit_code == 1 and "did you mean 'interval_seconds'" in refused.output
    both = CliRunner().invoke(main, ["check-config", good, "--config", good])
    assert both.exit_code == 2 and "not both" in both.output
    neither = CliRunner().invoke(main, ["check-config"])
    assert neither.exit_code == 2 and "--config FILE" in neither.output
