"""``_report.json`` against its committed JSON Schema, its TypedDicts and docs/report.md's table.

The reports validated here come from real runs of :func:`pipeline.run` on real Parquet shards
(several row groups each): a success, a resumed run (one lost shard scored again from the same
input, one skipped: the same dataset, so the first run's verdict), a rerun that finds everything
done, a run failed by the error
budget (rejected rows and an unreadable shard), a run stopped by a fatal invalid row, a run that
takes over the lock of a dead process, and a run that skips a shard whose columns do not fit the
model.
"""

from __future__ import annotations

import copy
import enum
import json
import math
import re
import subprocess
import sys
import types
import typing
from collections import abc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import pipeline
from pipeline.cli.demo import make_rows
from pipeline.core.config import PRECISIONS, ErrorPolicy, JobConfig
from pipeline.core.statuses import FailureKind, RunStatus, ShardStatus
from pipeline.model.bundle import FORMATS
from pipeline.report.schema import (
    SCHEMA_OBJECTS,
    SCHEMA_VERSION,
    ReportData,
    ReportSchemaError,
    report_schema,
    validate_report,
)
from tests.conftest import REPO, write_shards
from tests.integration.helpers import report_path

SCHEMA_FILE = REPO / "pipeline" / "schemas" / "report.schema.json"


def _resolve(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    node: Any = schema
    for part in pointer.lstrip("#").strip("/").split("/"):
        if part:
            node = node[part]
    assert isinstance(node, dict)
    return node


# ---------------------------------------------------------------- the schema against the code


def test_schema_file_is_a_valid_draft_2020_12_schema() -> None:
    import jsonschema

    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert schema == report_schema()  # the package reads the committed file
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["schema_version"] == {"const": SCHEMA_VERSION}
    assert SCHEMA_VERSION == 5


@pytest.mark.parametrize(
    ("definition", "values"),
    [
        ("run_status", [s.value for s in RunStatus]),
        ("shard_status", [s.value for s in ShardStatus]),
        ("failure_kind", [k.value for k in FailureKind]),
        ("precision", list(PRECISIONS)),
    ],
)
def test_schema_enums_equal_the_python_enums(definition: str, values: list[str]) -> None:
    assert report_schema()["$defs"][definition]["enum"] == values


def test_model_formats_equal_the_loader_formats() -> None:
    assert report_schema()["$defs"]["model"]["properties"]["format"]["enum"] == list(FORMATS)


def test_interrupted_is_a_run_status() -> None:
    assert RunStatus.INTERRUPTED == "interrupted"
    assert "interrupted" in report_schema()["$defs"]["run_status"]["enum"]


@pytest.mark.parametrize("pointer", sorted(SCHEMA_OBJECTS))
def test_typeddict_keys_equal_the_schema_properties(pointer: str) -> None:
    typed = SCHEMA_OBJECTS[pointer]
    node = _resolve(report_schema(), pointer)
    assert set(typed.__required_keys__) | set(typed.__optional_keys__) == set(node["properties"])
    assert set(typed.__required_keys__) == set(node["required"])


_JSON_TYPE = {str: "string", int: "integer", bool: "boolean", float: "number", type(None): "null"}


def _scalar_kinds(t: Any) -> set[str] | None:
    """The JSON kinds of a scalar annotation (None: not a scalar)."""
    if t is Any:
        return {"any"}
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return {"string"}
    if typing.get_origin(t) is typing.Literal:
        return {_JSON_TYPE[type(a)] for a in typing.get_args(t)}
    return {_JSON_TYPE[t]} if t in _JSON_TYPE else None


def _python_kinds(t: Any) -> set[str]:
    """What JSON an annotation of a report TypedDict allows: JSON types, ``array[...]`` of
    its items, ``object:#/$defs/x`` for another TypedDict of the report."""
    origin = typing.get_origin(t)
    scalar = _scalar_kinds(t)
    if scalar is not None:
        return scalar
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_python_kinds(a) for a in typing.get_args(t)))
    if origin in (typing.Annotated, typing.Required, typing.NotRequired):
        return _python_kinds(typing.get_args(t)[0])
    if origin in (list, tuple, abc.Sequence):
        item = (typing.get_args(t) or (Any,))[0]
        return {"array[" + ",".join(sorted(_python_kinds(item))) + "]"}
    if typing.is_typeddict(t):
        pointers = {v: k for k, v in SCHEMA_OBJECTS.items()}
        return {"object:" + pointers.get(t, "? " + t.__name__)}
    assert origin in (dict, abc.Mapping) or t is dict, f"no JSON kind for {t!r}"
    return {"object"}


def _schema_kinds(schema: dict[str, Any], node: Any) -> set[str]:
    """The same for a property of the JSON Schema (``anyOf`` members that only constrain, such
    as ``{"maxItems": 0}``, add no kind)."""
    if node is True or node == {}:
        return {"any"}
    if "$ref" in node:
        if node["$ref"] in SCHEMA_OBJECTS:
            return {"object:" + node["$ref"]}
        return _schema_kinds(schema, _resolve(schema, node["$ref"]))
    kinds: set[str] = set()
    for member in [*node.get("anyOf", []), *node.get("oneOf", [])]:
        kinds |= _schema_kinds(schema, member) - {"any"}
    types_ = node.get("type", [])
    for name in [types_] if isinstance(types_, str) else types_:
        items = ",".join(sorted(_schema_kinds(schema, node.get("items", {}))))
        kinds.add(f"array[{items}]" if name == "array" else name)
    if "type" not in node:
        kinds |= {_JSON_TYPE[type(v)] for v in node.get("enum", [])}
        kinds |= {_JSON_TYPE[type(node["const"])]} if "const" in node else set()
    return kinds or {"any"}


def _type_disagreements(schema: dict[str, Any]) -> list[str]:
    def fold(kinds: set[str]) -> set[str]:  # a JSON number takes an integer
        return {"number" if k == "integer" and "number" in kinds else k for k in kinds}

    found = []
    for pointer, typed in SCHEMA_OBJECTS.items():
        props = _resolve(schema, pointer)["properties"]
        for key, annotation in typing.get_type_hints(typed, include_extras=True).items():
            ours, theirs = fold(_python_kinds(annotation)), fold(_schema_kinds(schema, props[key]))
            if ours != theirs:
                found.append(f"{pointer} {key}: TypedDict {sorted(ours)}, schema {sorted(theirs)}")
    return found


def test_typeddict_value_types_agree_with_the_schema_types() -> None:
    # Both are written by hand (the schema carries descriptions and bounds a TypedDict cannot);
    # this keeps them from drifting apart: keys above, value types here, nested objects by name.
    assert _type_disagreements(report_schema()) == []


def test_the_type_comparison_sees_a_changed_type() -> None:
    schema = copy.deepcopy(report_schema())
    schema["$defs"]["shard"]["properties"]["rows_out"] = {"type": "string"}
    schema["$defs"]["execution"]["properties"]["parity"] = {"$ref": "#/$defs/threads"}
    found = _type_disagreements(schema)
    assert len(found) == 2, found
    assert any("rows_out" in f for f in found) and any("parity" in f for f in found)


def test_every_object_in_the_schema_has_a_typeddict() -> None:
    schema = report_schema()
    objects = {f"#/$defs/{k}" for k, v in schema["$defs"].items() if v.get("type") == "object"}
    assert objects | {"#"} == set(SCHEMA_OBJECTS)
    assert SCHEMA_OBJECTS["#"] is ReportData


# ---------------------------------------------------------------- docs/report.md

REPORT_DOC = REPO / "docs" / "report.md"


def _report_doc_keys() -> tuple[int, set[str]]:
    text = REPORT_DOC.read_text(encoding="utf-8")
    m = re.search(r"^## Run report \(`_report\.json`, `schema_version` (\d+)\)$", text, re.M)
    assert m, "docs/report.md has no '## Run report (`_report.json`, `schema_version` N)' heading"
    section = text[m.end() :].split("\n## ", 1)[0]
    keys: set[str] = set()
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) > 2 and line.startswith("|") and "`" in cells[1]:
            keys.update(re.findall(r"`([^`]+)`", cells[1]))
    return int(m.group(1)), keys


def test_report_doc_table_lists_exactly_the_schema_keys() -> None:
    version, keys = _report_doc_keys()
    assert version == SCHEMA_VERSION
    props = set(report_schema()["properties"])
    assert keys - props == set(), "docs/report.md lists keys the schema does not have"
    assert props - keys == set(), "docs/report.md's Run report table misses these keys"


def test_report_doc_names_every_status_and_failure_kind() -> None:
    text = REPORT_DOC.read_text(encoding="utf-8")
    section = text.split("## Run report", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if "|" in line}
    for key, values in (("`status`", RunStatus), ("`errors`", FailureKind)):
        missing = [v.value for v in values if f"`{v.value}`" not in rows[key]]
        assert not missing, f"docs/report.md's {key} row does not name {missing}"


# ---------------------------------------------------------------- the validator refuses


def _minimal_valid() -> dict[str, Any]:
    """A report that validates, built from the schema's own required keys (no run needed)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": "20261201T000000Z-abcdef",
        "job": "j",
        "status": "failed",
        "failure_reasons": ["x"],
        "started_at": "2026-12-01T00:00:00+00:00",
        "finished_at": "2026-12-01T00:00:01+00:00",
        "duration_s": 1.0,
        "input": "/in",
        "output": "/out",
        "rejects": "/out/_rejects",
        **dict.fromkeys(("rows_in", "rows_out", "rows_rejected", "rows_processed"), 0),
        "rows_per_s": 0.0,
        "rejected_fraction": 0.0,
        "accounting_ok": True,
        **dict.fromkeys(
            (
                "shards_total",
                "shards_scored",
                "shards_skipped",
                "shards_failed",
                "shards_not_scored",
            ),
            0,
        ),
        "batch_size": 1,
        "execution": {
            "precision": "fp32",
            "compile": False,
            "compile_s": None,
            "tf32": False,
            "overlap": True,
            "parity": None,
            "batch_size_auto": None,
        },
        "device": "cpu",
        "threads": {
            "scheduler": "sync",
            "cores": 1,
            "workers": 1,
            "threads_per_worker": 1,
            "torch_threads": 1,
        },
        "model": {
            "uri": "/m",
            "name": "m",
            "version": "1",
            "format": "torchscript",
            "sha256": "0" * 64,
            "width": 1,
            "out_width": 1,
        },
        "settings": {
            "inputs": ["f"],
            "outputs": [["s", "identity"]],
            "id_column": "id",
            "passthrough": [],
            "precision": "fp32",
        },
        "error_budget": {"max_failed_shards": 0, "max_rejected_fraction": 0.0},
        "lock_taken_over": None,
        "oom_splits": 0,
        "duplicate_ids": 0,
        "null_ids": 0,
        "versions": {"python": "3", "torch": "2", "pyarrow": "26", "dask": "2026"},
        "batch_latency_ms": {"p50": None, "p95": None, "p99": None},
        "outputs": {},
        "rejects_by_reason": {},
        "throughput": [{"t_s": 0.0, "rows": 0}],
        "drift": None,
        "verdict": None,
        "errors": [],
        "warnings": [],
        "lossy_casts": [],
        "removed_outputs": [],
        "foreign_removed": [],
        "foreign_kept": [],
        "shards": [],
    }


def test_minimal_report_validates() -> None:
    validate_report(_minimal_valid())


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda r: r.update(surprise=1), "surprise"),
        (lambda r: r.pop("warnings"), "warnings"),
        (lambda r: r.update(status="ok"), "$.status"),
        (lambda r: r.update(schema_version=2), "$.schema_version"),
        (lambda r: r.update(rows_out=-1), "$.rows_out"),
        (lambda r: r.update(errors=[{"shard": "s", "kind": "oops", "message": ""}]), "kind"),
        (lambda r: r["execution"].update(parity={"rows": 1}), "$.execution.parity"),
        (lambda r: r.update(rows_per_s=math.nan), "$.rows_per_s"),
        (lambda r: r.update(outputs={"s": {"count": 1, "mean": math.inf}}), "$.outputs.s.mean"),
        (lambda r: r.update(drift={"baseline": None}), "$.drift"),
    ],
)
def test_validator_refuses_and_names_the_key(change: Any, where: str) -> None:
    report = _minimal_valid()
    change(report)
    with pytest.raises(ReportSchemaError) as info:
        validate_report(report)
    assert where in str(info.value)


# ---------------------------------------------------------------- real runs


def _job(bundle: Path, inp: Path, out: Path, **kw: Any) -> JobConfig:
    return JobConfig(
        input=str(inp),
        output=str(out),
        model=str(bundle),
        name=kw.pop("name", "schema-test"),
        scheduler="sync",
        device="cpu",
        batch_size=512,
        **kw,
    )


def _with_nans(path: Path, start: int, n: int, every: int) -> None:
    """A shard whose f3 is NaN on every ``every``-th row (rejected rows), 3 row groups."""
    table = make_rows(start, n, seed=1)
    idx = pa.array([i % every == 0 for i in range(n)])
    f3 = pc.if_else(idx, pa.scalar(math.nan, pa.float32()), table.column("f3"))
    table = table.set_column(table.schema.get_field_index("f3"), "f3", f3)
    pq.write_table(table, path, row_group_size=max(1, n // 3))


def _check(report: pipeline.RunReport, out: Path) -> dict[str, Any]:
    """The report returned and the one on disk are the same, and both match the schema."""
    on_disk = json.loads(report_path(out).read_text(encoding="utf-8"))
    assert on_disk == json.loads(json.dumps(report.data))
    validate_report(on_disk)
    return on_disk


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, bundle_dir: Path) -> dict[str, dict[str, Any]]:
    """Each scenario's ``_report.json``, from real runs."""
    root = tmp_path_factory.mktemp("schema-runs")
    got: dict[str, dict[str, Any]] = {}

    good = root / "good"
    write_shards(good, [2500, 1700], row_group_rows=1000)
    out = root / "scored" / "good"
    got["success"] = _check(pipeline.run(_job(bundle_dir, good, out)), out)
    (out / "part-00001.parquet").unlink()  # lost: the resume scores it again, skips the other
    got["resumed"] = _check(pipeline.run(_job(bundle_dir, good, out)), out)
    got["all_done"] = _check(pipeline.run(_job(bundle_dir, good, out)), out)

    bad = root / "bad"
    write_shards(bad, [1500], row_group_rows=500)
    _with_nans(bad / "part-00001.parquet", 10_000, 1200, every=7)
    (bad / "part-00002.parquet").write_bytes(b"not parquet at all")
    out = root / "scored" / "budget"
    budget = ErrorPolicy(max_failed_shards=0, max_rejected_fraction=0.0)
    got["budget_failed"] = _check(
        pipeline.run(_job(bundle_dir, bad, out, name="budget", errors=budget)), out
    )

    out = root / "scored" / "fatal"
    fatal = ErrorPolicy(on_invalid_rows="fail", max_failed_shards=5)
    got["fatal"] = _check(pipeline.run(_job(bundle_dir, bad, out, name="fatal", errors=fatal)), out)

    # A run that takes over the lock of a process that died holding it (SIGKILL, OOM killer).
    out = root / "scored" / "takeover"
    dead = (
        "import os, sys\n"
        "from pipeline.io import storage\n"
        "from pipeline.io.locking import RunLock\n"
        "RunLock.acquire(storage.locate(sys.argv[1]), 'dead-run', stale_after_s=3600)\n"
        "os._exit(0)  # no release: the lock stays behind, its holder gone\n"
    )
    subprocess.run([sys.executable, "-c", dead, str(out)], check=True, cwd=REPO, timeout=120)
    got["lock_takeover"] = _check(pipeline.run(_job(bundle_dir, good, out, name="takeover")), out)

    odd = root / "odd"
    write_shards(odd, [1200, 900], row_group_rows=400)
    pq.write_table(make_rows(50_000, 800, 2).drop(["f3"]), odd / "part-00002.parquet", 300)
    out = root / "scored" / "skip"
    skip = ErrorPolicy(on_schema_error="skip_shard", max_failed_shards=1)
    got["schema_skip"] = _check(
        pipeline.run(_job(bundle_dir, odd, out, name="skip", errors=skip)), out
    )
    return got


@pytest.mark.slow  # real runs (the module's ``runs`` fixture)
def test_success(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["success"]
    assert r["status"] == RunStatus.SUCCEEDED and r["schema_version"] == SCHEMA_VERSION
    assert {s["status"] for s in r["shards"]} == {ShardStatus.SCORED}
    assert r["drift"]["baseline"] is None and "no previous" in r["drift"]["note"]


@pytest.mark.slow  # real runs (the module's ``runs`` fixture)
def test_resumed_run_skips_what_is_done_and_keeps_the_datasets_verdict(
    runs: dict[str, dict[str, Any]],
) -> None:
    r = runs["resumed"]
    assert [s["status"] for s in r["shards"]] == [ShardStatus.SKIPPED, ShardStatus.SCORED]
    # The lost file was scored again from the same input: the dataset is the one the first run
    # judged, so its verdict stands (it is not compared with itself).
    first = runs["success"]
    assert r["verdict"]["dataset"] == first["verdict"]["dataset"]
    assert r["verdict"]["reused"] is True and r["verdict"]["judged_by"] == first["run_id"]
    assert r["drift"] == first["drift"]
    done = runs["all_done"]
    assert done["shards_skipped"] == 2 and done["rows_processed"] == 0
    # A rerun that scores nothing still describes the whole output (issue: "a rerun describes
    # the dataset"): outputs come from the skipped shards' manifest statistics.
    assert done["drift"]["baseline"] is None and done["verdict"]["reused"] is True
    assert done["outputs"]["score"]["count"] == done["rows_out"]


@pytest.mark.slow  # real runs (the module's ``runs`` fixture)
def test_budget_failure(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["budget_failed"]
    assert r["status"] == RunStatus.FAILED and r["failure_reasons"]
    assert r["rows_rejected"] > 0 and r["rejects_by_reason"]
    assert [e["kind"] for e in r["errors"]] == [FailureKind.UNREADABLE]
    assert r["shards"][2]["rows_in"] is None
    assert r["drift"] is None  # not compared: the run failed


@pytest.mark.slow  # real runs (the module's ``runs`` fixture)
def test_fatal_invalid_row(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["fatal"]
    assert r["status"] == RunStatus.FAILED
    assert FailureKind.INVALID_ROWS in {e["kind"] for e in r["errors"]}


@pytest.mark.slow  # real runs (the module's ``runs`` fixture)
def test_schema_skip(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["schema_skip"]
    assert r["status"] == RunStatus.SUCCEEDED_WITH_ERRORS
    assert r["shards"][2]["kind"] == FailureKind.SCHEMA and r["shards"][2]["status"] == "failed"


@pytest.mark.slow  # real runs (the module's ``runs`` fixture)
def test_lock_takeover(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["lock_takeover"]
    assert r["lock_taken_over"] is not None
    assert r["lock_taken_over"]["run_id"] == "dead-run" and r["lock_taken_over"]["reason"]
    assert any("stale lock" in w for w in r["warnings"])


@pytest.mark.slow  # real runs (the module's ``runs`` fixture)
def test_a_real_report_with_a_changed_key_is_refused(runs: dict[str, dict[str, Any]]) -> None:
    report = copy.deepcopy(runs["resumed"])
    report["shards"][0]["status"] = "done"
    with pytest.raises(ReportSchemaError, match=r"\$\.shards\[0\]\.status"):
        validate_report(report)
