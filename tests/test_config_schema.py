"""The one configuration schema: every error at once, check-config's output accepted back, the
files a configuration names, sizes vs counts, hostile YAML, and the generated reference."""
import subprocess
import sys
import typing
from pathlib import Path

import bcrypt
import pytest
import yaml
from click.testing import CliRunner
from pydantic import BaseModel

from exporter.cli import main
from exporter.config import Config, ConfigError, build, file_form, load
from exporter.config.docs import render
from exporter.config.fields import Doc
from exporter.config.web import WebConfig, load_web_config
from exporter.config.yamlfile import YamlError, parse_yaml, read_yaml
from exporter.sim.scenario import SCENARIO_DIR

ROOT = Path(__file__).resolve().parent.parent
HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
# 342 bytes that expand to 10^9 strings once anything walks them.
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


def check_config(path):
    return CliRunner().invoke(main, ["check-config", str(path)])


def write(tmp_path, text, name="c.yml"):
    path = tmp_path / name
    path.write_text(text if isinstance(text, str) else yaml.safe_dump(text))
    return path


def problems(data):
    with pytest.raises(ConfigError) as err:
        build(data)
    return err.value.problems


# -- every error at once, in the file's own terms ---------------------------------------------
def test_three_errors_give_three_problems_each_naming_its_key(tmp_path):
    path = write(tmp_path, "interval_seconds: 0\nhistory: {raw_seconds: fast}\n"
                           "vllm:\n  endpoints:\n    - {url: 'http://x:1/m', timeout: 1}\n")
    result = check_config(path)
    assert result.exit_code == 1
    lines = [line.strip() for line in result.output.splitlines() if line.startswith("  ")]
    assert lines == ["interval_seconds: must be positive, got 0",
                     "history.raw_seconds: expected a finite number, got 'fast'",
                     "vllm.endpoints[0].timeout: unknown key (did you mean 'timeout_seconds'?)"]


def test_an_exponent_yaml_reads_as_text_is_explained(tmp_path):
    """PyYAML (YAML 1.1) reads 1e9 as the string '1e9': "expected a finite number, got '1e9'"
    looked wrong to a newcomer."""
    path = write(tmp_path, "vllm:\n  endpoints:\n    - {url: 'http://x:1/m', idle_read_seconds: 1e3}\n")
    result = check_config(path)
    assert result.exit_code == 1
    assert ("vllm.endpoints[0].idle_read_seconds: expected a finite number, got '1e3' (YAML reads an exponent "
            "without a dot as text: write 1.0e+9 or 1000000000)") in result.output
    assert check_config(write(tmp_path, "vllm:\n  endpoints:\n    - {url: 'http://x:1/m', "
                                        "idle_read_seconds: 1.0e+3}\n")).exit_code == 0


def test_check_config_prints_a_nested_file_it_accepts_again(tmp_path):
    first = write(tmp_path, "interval_seconds: 2\nhistory: {raw_seconds: 1800}\nkubelet: {enabled: false}\n"
                            "recorder: {max_total_bytes: 1GiB, max_files: 3}\n"
                            "vllm:\n  endpoints: [http://127.0.0.1:8000/metrics]\n")
    out = check_config(first)
    assert out.exit_code == 0, out.output
    printed = yaml.safe_load(out.output)
    assert printed["history"]["raw_seconds"] == 1800 and "history_raw_seconds" not in printed
    assert printed["recorder"]["max_total_bytes"] == "1GiB"
    second = write(tmp_path, out.output, "again.yml")
    again = check_config(second)
    assert again.exit_code == 0, again.output
    assert yaml.safe_load(again.output) == printed
    assert load(str(second)) == load(str(first))


def test_documented_defaults_are_the_schema_defaults_and_load_back(tmp_path):
    assert build(yaml.safe_load(yaml.safe_dump(Config().model_dump(mode="json")))) == Config()


# -- what run would reject, check-config rejects ----------------------------------------------
@pytest.mark.parametrize("data, message", [
    ({"vllm": {"endpoints": [{"url": "http://x:1/m", "max_response_bytes": 0}]}},
     "vllm.endpoints[0].max_response_bytes: must be at least 1KiB"),
    ({"vllm": {"endpoints": ["http://127.0.0.1:99999/metrics"]}}, "vllm.endpoints[0].url: not a valid URL"),
    ({"vllm": {"endpoints": ["http://[::1/metrics"]}}, "vllm.endpoints[0].url: not a valid URL"),
    ({"interval_seconds": 10**400}, "interval_seconds: expected a finite number"),
    ({"vllm": {"endpoints": [{"url": "http://x:1/m", "container_id": "  "}]}},
     "vllm.endpoints[0].container_id: must not be blank"),
    ({"kubelet": {"url": "https://[fe80::1/pods"}}, "kubelet.url: not a valid URL"),
    ({"listen": "[::1:9842"}, "listen: expected HOST:PORT"),
    ({"interval_seconds": 1e12}, "interval_seconds: must be at most 31622400"),
])
def test_what_run_would_crash_on_is_rejected_with_a_clear_message(tmp_path, data, message):
    result = check_config(write(tmp_path, data))
    assert result.exit_code == 1 and message in result.output


@pytest.mark.parametrize("text", [
    "vllm:\n  endpoints: [{url: 'http://x:1/m', max_response_bytes: 0}]\n",
    "vllm:\n  endpoints: ['http://127.0.0.1:99999/metrics']\n",
    "vllm:\n  endpoints: ['http://[::1/metrics']\n",
    "interval_seconds: " + "9" * 400 + "\n",
])
@pytest.mark.integration
def test_run_refuses_the_same_files_without_a_traceback(tmp_path, text):
    path = write(tmp_path, text)
    proc = subprocess.run([sys.executable, "-m", "exporter", "run", "--config", str(path), "--simulate", "steady",
                           "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "invalid configuration" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_files_the_configuration_names_are_checked(tmp_path, tls_cert):
    cert, key = tls_cert
    token, empty = tmp_path / "token", tmp_path / "empty"
    token.write_text("s3cret-token\n")
    empty.write_text("\n")
    good_web = write(tmp_path, {"tls_server_config": {"cert_file": cert, "key_file": key},
                                "basic_auth_users": {"prom": HASH}}, "web.yml")
    assert build({"web_config_file": str(good_web),
                  "vllm": {"endpoints": [{"url": "http://x:1/m", "bearer_token_file": str(token)}]}})
    bad_web = write(tmp_path, {"tls_server_config": {"cert_file": str(tmp_path / "nope.pem"), "key_file": key},
                               "basic_auth_users": {"prom": "plaintext-password"}}, "bad-web.yml")
    found = problems({"web_config_file": str(bad_web),
                      "vllm": {"endpoints": [{"url": "http://x:1/m", "bearer_token_file": str(tmp_path / "none")},
                                             {"url": "http://x:2/m", "bearer_token_file": str(empty)}]},
                      "kubelet": {"enabled": True, "token_file": str(tmp_path / "none"),
                                  "ca_file": str(tmp_path / "none.crt")}})
    text = "\n".join(found)
    assert "plaintext-password" not in text and "s3cret" not in text
    for message in ["web_config_file: invalid web config file:", "bad-web.yml: tls_server_config: cannot load",
                    "bad-web.yml: basic_auth_users.prom: expected a bcrypt hash",
                    "vllm.endpoints[0].bearer_token_file: cannot read token file",
                    "vllm.endpoints[1].bearer_token_file: token file", "kubelet.token_file: cannot read",
                    "kubelet.ca_file: cannot load CA certificates"]:
        assert message in text, (message, text)


def test_kubelet_files_are_checked_only_where_the_kubelet_uses_them(tmp_path):
    missing = str(tmp_path / "none")
    assert build({"kubelet": {"enabled": False, "token_file": missing, "ca_file": missing}})
    assert build({"kubelet": {"enabled": "auto", "token_file": missing, "ca_file": missing}})  # not in a pod
    assert build({"kubelet": {"enabled": True, "url": "http://node:10255/pods", "token_file": missing}})
    assert build({"kubelet": {"enabled": True, "insecure_skip_verify": True, "token_file": "", "ca_file": missing}})


def test_the_detectors_own_needs_are_part_of_the_one_validation():
    assert problems({"history": {"raw_seconds": 600}}) == [
        "history.raw_seconds: is 600; must be at least detectors.stale_memory.lookback_seconds (900), "
        "the history that detector reads"]
    assert problems({"detectors": {"contention": {"window_seconds": 2000}}}) == [
        "history.raw_seconds: is 3600; must be at least 2 x detectors.contention.window_seconds (4000), "
        "the history that detector reads"]


def test_each_detector_declares_its_section_and_checks_it_itself():
    """The sections come from the detectors' declarations; a value that breaks a detector's own
    rule across keys is reported at its section with the detector's words, unchanged."""
    from exporter.analysis.registry import DETECTORS

    config = build({"detectors": {"contention": {"min_bytes": "1GiB"}, "kv_saturation": {"min_waiting": 4}}})
    analysis = config.analysis()
    assert analysis.detectors["contention"].min_bytes == 1 << 30
    assert analysis.detectors["kv_saturation"].min_waiting == 4
    assert analysis.detectors["stale_memory"] == build().analysis().detectors["stale_memory"]  # defaults
    assert set(file_form(config)["detectors"]) == {spec.name for spec in DETECTORS}
    assert problems({"detectors": {"stale_memory": {"lookback_seconds": 100}}}) == [
        "detectors.stale_memory: stale: lookback_seconds must cover seconds and exit_grace_seconds"]
    assert problems({"detectors": {"kv_saturation": {"usage_ratio": 2, "nope": 1}}}) == [
        "detectors.kv_saturation.usage_ratio: must be at most 1, got 2",
        "detectors.kv_saturation.nope: unknown key (known keys: usage_ratio, window_seconds, min_full_share, "
        "min_waiting, min_queued_share, clear_full_share)"]
    # Statistical constants a detector does not list stay out of the file.
    assert problems({"detectors": {"leak": {"min_z": 2}}})[0].startswith("detectors.leak.min_z: unknown key")


def test_the_leak_budget_reaches_the_detector_and_is_checked():
    from exporter.analysis import leak_detector

    config = build({"detectors": {"leak": {"false_alarms_per_day": 0.5}}})
    leak = config.analysis().section(leak_detector.DETECTOR)
    assert leak.false_alarms_per_day == 0.5
    assert build({}).analysis().section(leak_detector.DETECTOR).threshold() > leak.threshold()
    assert problems({"detectors": {"leak": {"false_alarms_per_day": 0}}})[0].startswith("detectors.leak")
    assert problems({"detectors": {"leak": {"false_alarms_per_day": 2000}}})[0].startswith("detectors.leak")


def test_web_config_reports_every_problem(tmp_path):
    path = write(tmp_path, "tls_server_config: {cipher: x, min_version: TLS9}\nbasic_auth_users: {'a:b': x}\n")
    with pytest.raises(ConfigError) as err:
        load_web_config(str(path))
    assert len(err.value.problems) == 4, err.value.problems


# -- sizes and counts -------------------------------------------------------------------------
def test_a_count_is_not_a_size():
    assert problems({"recorder": {"max_files": "1KiB"}}) == ["recorder.max_files: expected a whole number, got '1KiB'"]
    assert build({"recorder": {"max_total_bytes": "1GiB"}}).recorder.max_total_bytes == 1 << 30


def _fields(model: type[BaseModel], prefix=""):
    for name, info in model.model_fields.items():
        typ = info.annotation
        inner = [a for a in typing.get_args(typ) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(typ, type) and issubclass(typ, BaseModel):
            yield from _fields(typ, prefix + name + ".")
        elif inner:
            yield from _fields(inner[0], prefix + name + "[].")
        else:
            yield prefix + name, info


@pytest.mark.parametrize("model", [Config, WebConfig])
def test_exactly_the_bytes_keys_are_sizes(model):
    for key, info in _fields(model):
        is_size = any(isinstance(m, Doc) and m.type == "size" for m in info.metadata)
        assert is_size == key.endswith("_bytes"), key


# -- the new keys -----------------------------------------------------------------------------
def test_health_listen_and_recorder_tail():
    config = build()
    assert config.health_listen == "" and config.recorder.tail_seconds == 300.0
    assert build({"health_listen": "127.0.0.1:9843", "recorder": {"tail_seconds": 0}}).health_listen == "127.0.0.1:9843"
    assert problems({"health_listen": "nowhere"})[0].startswith("health_listen: expected HOST:PORT")
    assert problems({"health_listen": ":9842"}) == ["health_listen: must use another port than listen"]
    assert problems({"recorder": {"tail_seconds": -1}}) == ["recorder.tail_seconds: must not be negative, got -1"]


def test_flags_override_the_file_and_are_checked_the_same_way(tmp_path):
    path = str(write(tmp_path, {"listen": "127.0.0.1:1", "vllm": {"endpoints": ["http://a:1/m"]}}))
    config = load(path, {"listen": "127.0.0.1:2", "vllm.endpoints": ("http://b:2/m",)})
    assert config.listen == "127.0.0.1:2" and [e.url for e in config.vllm.endpoints] == ["http://b:2/m"]
    with pytest.raises(ConfigError, match="listen: expected HOST:PORT"):
        load(path, {"listen": "bogus"})


def test_error_messages_never_carry_huge_values():
    found = problems({"interval_seconds": "x" * 100_000, "listen": "y" * 100_000, "z" * 100_000: 1,
                      "vllm": {"endpoints": [{"url": "http://x:1/m", "max_response_bytes": 10**4000}]}})
    assert len(found) == 4 and all(len(p) < 300 for p in found), found


# -- hostile YAML -----------------------------------------------------------------------------
def test_alias_bombs_are_refused_in_configuration_and_web_config_files(tmp_path):
    assert len(BOMB) < 440
    for loader in (load, load_web_config):
        with pytest.raises(ConfigError, match=r"bomb.yml:1:4: .*anchors and aliases"):
            loader(str(write(tmp_path, BOMB, "bomb.yml")))


def test_with_aliases_allowed_the_expansion_is_bounded():
    with pytest.raises(YamlError, match="expands to more than"):
        parse_yaml(BOMB, "bomb.yml", allow_aliases=True)
    with pytest.raises(YamlError, match="expands to more than"):
        parse_yaml("&a [*a]", "loop.yml", allow_aliases=True)


def test_scenarios_read_the_same_with_aliases_allowed():
    for path in sorted(SCENARIO_DIR.glob("*.yaml")):
        text = path.read_text()
        assert parse_yaml(text, str(path), allow_aliases=True) == yaml.safe_load(text), path


@pytest.mark.parametrize("text, message", [
    ("a: 1\nlisten: x\nlisten: y\n", r"c.yml:3:1: not valid YAML: duplicate key 'listen'"),
    ("a: 1\nb: [unclosed\n", r"c.yml:3:1: not valid YAML: expected ',' or ']'"),
    ("a: 1\nb: \x01\n", r"c.yml:2: not valid YAML: control character #x0001"),
    ("n: " + "9" * 5000 + "\n", r"c.yml:1:4: not valid YAML: a value that cannot be read as int"),
    ("a: " + "[" * 5000, r"c.yml: not valid YAML: nested too deeply"),
    ("a: !!python/object:os.system {}\n", r"c.yml:1:4: not valid YAML: could not determine a constructor"),
])
def test_yaml_errors_name_the_file_and_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(YamlError) as err:
        read_yaml(str(path))
    assert str(err.value).startswith(f"{path.parent}/{message}")


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "c.yml"
    path.write_bytes(b"a: 1\nb: \xff\n")
    with pytest.raises(YamlError, match=r"c.yml:2: not UTF-8"):
        read_yaml(str(path))


# -- the reference ----------------------------------------------------------------------------
def test_the_committed_reference_matches_the_schema():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is stale: python -m exporter.config.docs > docs/configuration.md")


def test_every_key_is_in_the_reference():
    text = render()
    for key, info in _fields(Config):
        assert f"`{key}`" in text and info.description, key
    for key, info in _fields(WebConfig):
        assert f"`{key}`" in text and info.description, key


def test_the_readme_example_is_a_valid_configuration():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Configuration"):]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = build(yaml.safe_load(example))
    assert config.vllm.endpoints[1].name == "llama-70b"

