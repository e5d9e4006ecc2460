"""The pipeline models and loader: every field, interpolation, every kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose.config import DEFAULT_LATENCY_BUCKETS, DEFAULT_TRANSFER_BUCKETS, load_pipeline
from kvcompose.errors import PipelineConfigError
from kvcompose.interpolation import interpolate_env

FULL = """\
version: 1
name: full-pipeline
role: kv_producer
load:
  policy: longest_match
children:
  - name: hot
    connector: ExampleConnector
    config:
      shared_storage_path: /tmp/hot
  - name: remote_1
    connector: MyConnector
    module_path: my_pkg.connectors
    role: kv_consumer
    load: false
    save: true
    config:
      url: "redis://x"
    transfer: {kv_buffer_device: cpu, kv_port: 15000, engine_id: e1}
tracing:
  enabled: true
  service_name: svc
  exporter: console
  endpoint: http://127.0.0.1:4318/v1/traces
  sample_ratio: 0.25
  granularity: step
metrics:
  enabled: false
  per_layer: true
  latency_buckets: [0.001, 0.01, 0.1]
logging: {format: json, level: DEBUG}
"""


def write(tmp_path: Path, text: str, name: str = "pipeline.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(source: object) -> list[str]:
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(source)  # type: ignore[arg-type]
    return str(caught.value).splitlines()


def test_every_field_is_read(tmp_path: Path) -> None:
    p = load_pipeline(write(tmp_path, FULL))
    assert (p.version, p.name, p.role, p.load.policy) == (1, "full-pipeline", "kv_producer", "longest_match")
    hot, remote = p.children
    assert (hot.name, hot.connector, hot.module_path, hot.role, hot.load, hot.save) == (
        "hot", "ExampleConnector", None, None, True, True)
    assert hot.config == {"shared_storage_path": "/tmp/hot"} and hot.transfer == {}
    assert p.child_role(hot) == "kv_producer" and p.child_role(remote) == "kv_consumer"
    assert (remote.module_path, remote.load, remote.save) == ("my_pkg.connectors", False, True)
    assert remote.transfer == {"kv_buffer_device": "cpu", "kv_port": 15000, "engine_id": "e1"}
    t = p.tracing
    assert (t.enabled, t.service_name, t.exporter, t.endpoint, t.sample_ratio, t.granularity) == (
        True, "svc", "console", "http://127.0.0.1:4318/v1/traces", 0.25, "step")
    assert (p.metrics.enabled, p.metrics.per_layer, p.metrics.latency_buckets) == (False, True, (0.001, 0.01, 0.1))
    assert (p.logging.format, p.logging.level) == ("json", "DEBUG")


def test_defaults() -> None:
    p = load_pipeline({"version": 1, "name": "d", "children": [{"name": "a", "connector": "ExampleConnector"}]})
    assert (p.role, p.load.policy, p.children[0].load, p.children[0].save) == ("kv_both", "first_match", True, True)
    assert (p.tracing.enabled, p.tracing.granularity, p.tracing.exporter) == (False, "request", "otlp")
    assert p.metrics.latency_buckets == DEFAULT_LATENCY_BUCKETS
    assert DEFAULT_LATENCY_BUCKETS[0] == pytest.approx(1e-6) and DEFAULT_LATENCY_BUCKETS[-1] == 10.0
    assert p.metrics.transfer_buckets == DEFAULT_TRANSFER_BUCKETS
    assert DEFAULT_TRANSFER_BUCKETS[0] == pytest.approx(1e-5) and DEFAULT_TRANSFER_BUCKETS[-1] >= 30.0


def test_json_file_is_read_with_lines(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n "version": 1,\n "name": "j",\n "children": [\n  {"name": "a", "connector": 3}\n ]\n}\n',
                 "p.json")
    assert problems(path) == [f"{path}:5: children[0].connector: Input should be a valid string"]


def test_interpolation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVC_DIR", "/data/kv")
    monkeypatch.delenv("KVC_UNSET", raising=False)
    text = FULL.replace("/tmp/hot", "${KVC_DIR}/hot").replace("redis://x", "${KVC_UNSET:-redis://fallback}")
    text = text.replace("service_name: svc", "service_name: $${KVC_DIR}")
    p = load_pipeline(write(tmp_path, text))
    assert p.children[0].config["shared_storage_path"] == "/data/kv/hot"
    assert p.children[1].config["url"] == "redis://fallback"
    assert p.tracing.service_name == "${KVC_DIR}"
    assert interpolate_env({"a": ["x${V:-}y", 3]}, {}) == ({"a": ["xy", 3]}, [])


def test_interpolation_into_typed_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVC_LOAD", "false")
    p = load_pipeline({"version": 1, "name": "x",
                       "children": [{"name": "a", "connector": "ExampleConnector", "load": "${KVC_LOAD}"}]})
    assert p.children[0].load is False


def test_unset_variable_names_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVC_MISSING", raising=False)
    path = write(tmp_path, FULL.replace("/tmp/hot", "${KVC_MISSING}"))
    assert problems(path) == [
        f"{path}:10: children[0].config.shared_storage_path: environment variable KVC_MISSING is not set "
        "(use ${KVC_MISSING:-default})"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("version: [1\n", "2: malformed YAML/JSON"),
        ("- a\n- b\n", "1: the pipeline must be a mapping, got a list"),
        ("", "1: the pipeline must be a mapping, got an empty document"),
        ("version: 1\nname: x\nname: y\nchildren: []\n", "3: name: duplicate key 'name' (first at line 2)"),
        ("version: 2\nname: x\nchildren: [{name: a, connector: ExampleConnector}]\n", "1: version: Input should be 1"),
        ("version: 1\nname: x\nchildren: []\n", "3: children: List should have at least 1 item"),
        ("version: 1\nname: x\n", "1: children: required key is missing"),
        ("version: 1\nname: x\nchildren:\n  - name: a\n    connector: ExampleConnector\n    laod: true\n",
         "6: children[0].laod: unknown key"),
        ("version: 1\nname: x\nchildren:\n  - name: a\n    connector: ExampleConnector\n    save: often\n",
         "6: children[0].save: Input should be a valid boolean"),
        ("version: 1\nname: x\nchildren:\n  - name: Hot Tier\n    connector: ExampleConnector\n",
         "4: children[0].name: 'Hot Tier' is not label-safe"),
        ("version: 1\nname: x\nchildren:\n  - {name: a, connector: ExampleConnector}\n"
         "  - {name: a, connector: ExampleConnector}\n",
         "5: children[1].name: duplicate child name 'a' (first used by children[0])"),
        ("version: 1\nname: x\nchildren:\n  - name: a\n    connector: ExampleConector\n",
         "5: children[0].connector: unknown connector 'ExampleConector'; did you mean 'ExampleConnector'?"),
        ("version: 1\nname: x\nchildren:\n  - name: a\n    connector: Zzzz\n",
         "5: children[0].connector: unknown connector 'Zzzz'; set module_path"),
        ("version: 1\nname: x\nchildren:\n  - name: a\n    connector: NixlConnector\n"
         "    transfer: {kv_buffer_devise: cpu}\n",
         "6: children[0].transfer: KVTransferConfig has no field 'kv_buffer_devise'"),
        ("version: 1\nname: x\nchildren:\n  - name: a\n    connector: NixlConnector\n    transfer: {kv_role: kv_both}\n",
         "6: children[0].transfer: 'kv_role' is set by kvcompose"),
        ("version: 1\nname: x\nchildren: [{name: a, connector: ExampleConnector}]\ntracing: {sample_ratio: 2}\n",
         "4: tracing.sample_ratio: Input should be less than or equal to 1"),
        ("version: 1\nname: x\nchildren: [{name: a, connector: ExampleConnector}]\ntracing: {granularity: token}\n",
         "4: tracing.granularity: Input should be 'request', 'step' or 'layer'"),
        ("version: 1\nname: x\nchildren: [{name: a, connector: ExampleConnector}]\nmetrics: {latency_buckets: [1, 0.5]}\n",
         "4: metrics.latency_buckets: bucket bounds must be strictly increasing"),
        ("version: 1\nname: x\nchildren: [{name: a, connector: ExampleConnector}]\nmetrics: {transfer_buckets: [0, 1]}\n",
         "4: metrics.transfer_buckets: bucket bounds must be positive"),
        ("version: 1\nname: x\nchildren: [{name: a, connector: ExampleConnector}]\nlogging: {format: xml}\n",
         "4: logging.format: Input should be 'json' or 'console'"),
    ],
)
def test_bad_input_names_field_and_line(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    found = problems(path)
    assert any(line.startswith(f"{path}:{expected}") for line in found), found


def test_missing_unreadable_and_directory(tmp_path: Path) -> None:
    assert problems(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: file not found"]
    assert problems(tmp_path) == [f"{tmp_path}: is a directory, not a pipeline file"]
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert problems(binary)[0].startswith(f"{binary}: cannot read file")


def test_mapping_errors_have_paths_but_no_lines() -> None:
    found = problems({"version": 1, "name": "x", "children": [{"name": "a", "connector": "ExampleConnector", "x": 1}]})
    assert found == ["children[0].x: unknown key (check the spelling; `kvcompose schema` lists every key)"]


def test_every_problem_is_reported_in_one_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A missing name used to hide the misspelled connector, and an unset variable everything else.
    monkeypatch.delenv("KVC_UNSET", raising=False)
    path = write(tmp_path, """\
version: 1
children:
  - name: hot
    connector: ExampleConector
    config: {path: "${KVC_UNSET}"}
  - connector: ExampleConnector
    sav: false
  - name: hot
    connector: ExampleConnector
    load: ${KVC_UNSET}
tracin: {enabled: true}
""")
    assert problems(path) == [
        f"{path}:1: name: required key is missing",
        f"{path}:4: children[0].connector: unknown connector 'ExampleConector'; did you mean 'ExampleConnector'?",
        f"{path}:5: children[0].config.path: environment variable KVC_UNSET is not set (use ${{KVC_UNSET:-default}})",
        f"{path}:6: children[1].name: required key is missing",
        f"{path}:7: children[1].sav: unknown key; did you mean 'save'?",
        f"{path}:8: children[2].name: duplicate child name 'hot' (first used by children[0]); names must be unique",
        f"{path}:10: children[2].load: environment variable KVC_UNSET is not set (use ${{KVC_UNSET:-default}})",
        f"{path}:11: tracin: unknown key; did you mean 'tracing'?",
    ]


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ("chidlren: []", "chidlren: unknown key; did you mean 'children'?"),
        ("laod: {policy: first_match}", "laod: unknown key; did you mean 'load'?"),
        ("load: {polcy: first_match}", "load.polcy: unknown key; did you mean 'policy'?"),
        ("metrics: {perlayer: true}", "metrics.perlayer: unknown key; did you mean 'per_layer'?"),
        ("logging: {levle: INFO}", "logging.levle: unknown key; did you mean 'level'?"),
        ("zzz: 1", "zzz: unknown key (check the spelling; `kvcompose schema` lists every key)"),
    ],
)
def test_unknown_keys_suggest_the_closest_known_key(section: str, expected: str, tmp_path: Path) -> None:
    path = write(tmp_path, f"version: 1\nname: x\nchildren: [{{name: a, connector: ExampleConnector}}]\n{section}\n")
    assert f"{path}:4: {expected}" in problems(path)


def test_unknown_keys_inside_children_suggest_too() -> None:
    child = {"name": "a", "connector": "ExampleConnector", "circuit_breaker": {"failurs": 3}, "modul_path": "m"}
    assert problems({"version": 1, "name": "x", "children": [child]}) == [
        "children[0].circuit_breaker.failurs: unknown key; did you mean 'failures'?",
        "children[0].modul_path: unknown key; did you mean 'module_path'?",
    ]


def test_each_problem_is_one_line_however_odd_the_input() -> None:
    child = {"name": "a\nb", "connector": "Example\nConnector", "config": {}, "typo\r\nkey": 1, "x" * 500: 1}
    found = problems({"version": 1, "name": "x", "children": [child]})
    assert len(found) == 4, found
    assert all(len(line) < 300 for line in found), found
