"""A model that returns NaN or infinity for some rows, through the real CLI: those rows are
rejects (named, counted against the error budget), never scores, and every JSON document the
run writes or prints stays strict JSON (no ``NaN`` or ``Infinity`` tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.cli.demo import export_bundle
from tests.conftest import demo_toml
from tests.integration.helpers import (
    CliResult,
    cli,
    control_of,
    data_files,
    job_args,
    report,
    report_path,
)
from tests.model.test_engine import INF_F0, NAN_F0, NonFiniteRows

pytestmark = pytest.mark.integration

REASON = "model output is not finite (score)"


def _strict(text: str, where: str) -> Any:
    """``text`` parsed by a strict JSON parser: a NaN, Infinity or -Infinity token fails."""

    def refuse(token: str) -> None:
        raise AssertionError(f"{where}: {token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _json_files(*roots: Path) -> list[Path]:
    found = [p for r in roots if r.exists() for p in r.rglob("*.json")]
    assert found
    return found


@pytest.fixture(scope="module")
def nonfinite_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Logit 0 is NaN where f0 > 1.5; every logit is +inf where f0 < -1.5."""
    d = tmp_path_factory.mktemp("nonfinite_bundle")
    torch.manual_seed(0)
    export_bundle(NonFiniteRows().eval(), d, demo_toml(), n_in=16)
    return d


def _run(inp: Path, out: Path, rejects: Path, bundle: Path, *extra: str) -> CliResult:
    opts = ("--rejects", str(rejects), "--batch-size", "512", "--scheduler", "sync")
    return cli("run", *job_args(inp, out, bundle, *opts, *extra), in_process=True)


def _bad_ids(catalog: Path) -> set[int]:
    t = pa.concat_tables([pq.read_table(p) for p in sorted(catalog.glob("*.parquet"))])
    f0 = t.column("f0").to_numpy()
    ids = t.column("item_id").to_numpy()
    return set(ids[(f0 > NAN_F0) | (f0 < INF_F0)].tolist())


def test_non_finite_rows_are_rejects_within_and_beyond_the_budget(
    catalog: Path, nonfinite_bundle: Path, tmp_path: Path
) -> None:
    bad = _bad_ids(catalog)
    assert 0.05 < len(bad) / 7300 < 0.2  # both kinds, well beyond the default 1% budget
    out, rejects = tmp_path / "out", tmp_path / "rejects"

    r = _run(catalog, out, rejects, nonfinite_bundle)
    assert r.returncode == 1, r.output
    rep = _strict(report_path(out).read_text(), "_report.json")
    assert rep["status"] == "failed" and not (out / "_SUCCESS").exists()
    assert "max_rejected_fraction" in " ".join(rep["failure_reasons"])
    assert rep["rows_rejected"] == len(bad) and rep["rejects_by_reason"] == {REASON: len(bad)}

    # Within a budget that allows them: the same rows (the rerun skips every shard, its report
    # still counts and names them from the manifest), exit 0, _SUCCESS.
    r = _run(catalog, out, rejects, nonfinite_bundle, "--max-rejected-fraction", "0.2")
    assert r.returncode == 0, r.output
    rep = report(out)
    assert rep["status"] == "succeeded_with_errors" and (out / "_SUCCESS").exists()
    assert rep["shards_skipped"] == 3 and rep["rows_processed"] == 0
    assert rep["rows_rejected"] == len(bad) and rep["rejects_by_reason"] == {REASON: len(bad)}
    assert rep["rows_out"] == 7300 - len(bad) == rep["outputs"]["score"]["count"]

    rej = pa.concat_tables([pq.read_table(p) for p in data_files(rejects)])
    assert set(rej.column("item_id").to_pylist()) == bad and rej.num_rows == len(bad)
    assert set(rej.column("reject_reason").to_pylist()) == {REASON}
    scored = pa.concat_tables([pq.read_table(p) for p in data_files(out)])
    assert scored.num_rows == 7300 - len(bad)
    assert not set(scored.column("item_id").to_pylist()) & bad
    assert np.isfinite(scored.column("score").to_numpy()).all()
    assert pc.all(pc.is_in(scored.column("label"), pa.array([0, 1]))).as_py()
    for p in _json_files(out, rejects, control_of(out)):
        _strict(p.read_text(), str(p))
    for stat in ("mean", "min", "max"):
        assert np.isfinite(rep["outputs"]["score"][stat])


def test_a_run_whose_every_row_is_rejected_writes_strict_json(
    catalog: Path, nonfinite_bundle: Path, tmp_path: Path
) -> None:
    for p in catalog.glob("*.parquet"):  # f0 > 1.5 everywhere: every output row has a NaN
        t = pq.read_table(p)
        i = t.schema.get_field_index("f0")
        t = t.set_column(i, "f0", pc.add(t.column("f0"), pa.scalar(10.0, pa.float32())))
        pq.write_table(t, p, row_group_size=1000)
    out, rejects = tmp_path / "out", tmp_path / "rejects"
    r = _run(catalog, out, rejects, nonfinite_bundle, "--log-format", "json")
    assert r.returncode == 1, r.output  # 100% rejected: over any budget below 1, not a crash
    rep = _strict(report_path(out).read_text(), "_report.json")
    report(out)  # and it matches the schema
    assert rep["rows_out"] == 0 and rep["rows_rejected"] == 7300
    assert rep["outputs"] == {"score": {"count": 0}, "label": {"count": 0}}
    assert rep["errors"] == []  # rows rejected, not shards failed as a broken model
    for p in _json_files(out, rejects, control_of(out)):
        _strict(p.read_text(), str(p))
    for line in r.stdout.splitlines() + r.stderr.splitlines():
        if line.startswith("{"):
            _strict(line, "log line")
    shown = cli("report", str(out), "--json", in_process=True)
    assert shown.returncode == 0, shown.output
    assert _strict(shown.stdout, "report --json")["rows_rejected"] == 7300
