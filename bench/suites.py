"""The comparators of each workload, how each is launched, and the figures derived from them.

Each comparator is one command run in a fresh process tree (see :mod:`bench.procs`). A suite
runs its comparators alternating, A B C D A B C D ..., so that a slow spell on the shared
machine spreads over all of them instead of landing on one.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.dataset as pads

from bench.loops import RESULT_PREFIX
from bench.procs import ProcRun, report_file, run_measured
from bench.stats import Sample, Summary, summarize
from bench.workloads import (
    Data,
    Sizes,
    cpu_has_native_bf16,
    shard_files,
    w1_features,
    w2_features,
)

BATCH = 4096
BIG_BATCH = 65_536
#: The forms Daft's scorer can load the model in (bench.daft_runner.load_program), and the one
#: the ``daft`` comparator, the headline's peer, uses: Daft's best here. Loading the bundle's
#: torch.export program in every UDF instance (``daft-export``, beside it on W1) cost Daft
#: 1.45x the wall of TorchScript on W1 (3 pairs, 2026-12-04); docs/tuning.md has this run's
#: figures for the three forms.
DAFT_FORMS = {
    "eager": "eager torch.nn module rebuilt from the bundle's weights",
    "torchscript": "TorchScript of the bundle's network",
    "export": "the bundle's torch.export program loaded per UDF instance",
}
DAFT_FORM = "eager"
FLOOR_TARGET = 1.0
# No single run of the full bench should take more than about a minute on 2 cores; a run that
# takes five is hung, and waiting longer would break the bench's 15-minute budget.
RUN_TIMEOUT_S = 300.0


@dataclass
class Comparator:
    """One thing measured: a command, how to read its result, and what it must have done."""

    key: str
    label: str
    layout: str
    batch: int | None
    argv: list[str]
    kind: str  # "loop" (bench.loops result line), "cli" (_report.json), "command" (wall only)
    rows: int  # rows it must report (0: nothing to check)
    output: Path | None = None  # removed before and after each run
    primary: str = "wall"  # "wall": rows / process wall time; "timed": the timed region's rate
    digest: Callable[[Path], dict[str, Any]] | None = None  # checksums of its output (rep 1)
    keep_output: bool = False  # rep 1's output is compared after the rep, then removed
    scratch: Path | None = None  # a folder the command may fill (a cache): emptied before run 1
    cold: bool = False  # the scratch folder is emptied before every run, not only the first
    # One untimed run before round 1 (after the scratch folder is emptied): every counted run
    # then finds what a first night leaves behind (a cached batch-size choice), as nights 2+ do.
    prime: bool = False
    # Exit codes that count as a run: Daft aborts at exit after a Delta write (SIGABRT) once its
    # result line is out (bench.delta); the code is kept in the sample's ``extra["exit"]``.
    exit_codes: tuple[int, ...] = (0,)
    # A "cli" run's _report.json when it is not beside ``output`` (a template's partition, as
    # ``data/scored/run_date={date}`` writes; or a table's night that must not be cleared).
    report: Path | None = None


@dataclass
class WorkloadResult:
    """Everything a workload's section of the report needs."""

    key: str
    title: str
    description: list[str]
    comparators: list[Comparator]
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    load_before: str = ""
    load_after: str = ""

    def primary(self, key: str) -> Summary | None:
        """The comparator's headline rows/s: process wall, or the timed region for ceilings."""
        comp = next((c for c in self.comparators if c.key == key), None)
        if comp is None:  # not measured in this run (skipped by the time budget, or --only)
            return None
        samples = self.samples.get(key, [])
        if comp.primary == "timed":
            return summarize(samples, lambda s: s.timed_rate)
        return summarize(samples, lambda s: s.wall_rate)

    def timed(self, key: str) -> Summary | None:
        """Rows/s of the comparator's timed region (after interpreter start-up and imports)."""
        return summarize(self.samples.get(key, []), lambda s: s.timed_rate)

    def per_proc(self, key: str) -> Summary | None:
        """Rows/s of one process of a multi-process layout."""
        return summarize(self.samples.get(key, []), lambda s: s.per_proc_mean)

    def rss(self, key: str) -> Summary | None:
        """Peak RSS of the whole process tree, in bytes."""
        return summarize(self.samples.get(key, []), lambda s: float(s.peak_rss_bytes))

    def wall(self, key: str) -> Summary | None:
        """Wall time of the whole process, in seconds."""
        return summarize(self.samples.get(key, []), lambda s: s.wall_s)


def clear_output(output: Path) -> None:
    """An output and what a run keeps beside it (control folder with its manifest, report and
    run index; default rejects), so that every run is a first run: no resume, and no drift
    check against another comparator's or an earlier bench's run."""
    for path in (
        output,
        output.parent / "_score_catalog" / output.name,
        output.parent / "_rejects" / output.name,
    ):
        shutil.rmtree(path, ignore_errors=True)


class Runner:
    """Launches comparators and records their samples, failures and leftovers."""

    def __init__(self, repo: Path, root: Path, log: Callable[[str], None]) -> None:
        self.repo = repo
        self.root = root
        self.python = sys.executable
        self.cli = str(Path(sys.executable).with_name("score-catalog"))
        # Daft lives in a venv of its own (it pins pyarrow below ours): make bench builds it.
        daft_python = repo / ".venv-daft" / "bin" / "python"
        self.daft_python = str(daft_python) if daft_python.exists() else None
        self.log = log
        self.leaks: list[str] = []
        self.warnings: list[str] = []  # things outside the measured runs that went wrong

    # -- argv builders -------------------------------------------------------------------------

    def loop_argv(self, kind: str, **args: Any) -> list[str]:
        """``python -m bench.loops`` with one comparator body and its arguments."""
        return [self.python, "-m", "bench.loops", json.dumps({"kind": kind, **args})]

    def daft(
        self,
        key: str,
        shards: list[str],
        out: Path,
        model: str,
        spec: dict[str, Any],
        rows: int,
        digest: Any,
        sink: str = "parquet",
        *,
        peer: Path,
        form: str = DAFT_FORM,
    ) -> Comparator | None:
        """Daft's native runner on the same shards and model, from ``.venv-daft`` (None, with
        a note in the report, when that venv is missing); ``sink``: ``parquet`` (a folder) or
        ``delta`` (``write_deltalake``); the model in ``form`` (:data:`DAFT_FORMS`; ``peer``:
        the folder of :func:`bench.workloads.peer_forms`)."""
        if self.daft_python is None:
            if "Daft: .venv-daft is missing" not in " ".join(self.warnings):
                self.warnings.append(
                    "Daft: .venv-daft is missing (make bench builds it); not measured"
                )
            return None
        args = {"kind": "daft", "shards": shards, "out_dir": str(out), "bundle": model}
        args |= {"form": form, "peer": str(peer)}
        argv = [
            self.daft_python,
            "-m",
            "bench.loops",
            json.dumps({**args, "spec": spec, "batch": BATCH, "sink": sink}),
        ]
        return Comparator(
            key,
            f"Daft 0.7 native runner (@daft.cls + @daft.method.batch, {DAFT_FORMS[form]}, "
            "DO_NOT_TRACK=1)",
            "Daft native runner, 1 torch thread per UDF instance",
            BATCH,
            argv,
            "loop",
            rows,
            output=out,
            digest=digest,
        )

    def cli_argv(
        self,
        input_: Path,
        output: Path,
        model: Path,
        batch: int | str,
        scheduler: str = "local",
        extra: tuple[str, ...] = (),
    ) -> list[str]:
        """``score-catalog run`` with the flags of a plain nightly job."""
        return [
            self.cli,
            "run",
            "--input",
            str(input_),
            "--output",
            str(output),
            "--model",
            str(model),
            "--batch-size",
            str(batch),
            "--scheduler",
            scheduler,
            *extra,
        ]

    def out_dir(self, workload: str, key: str) -> Path:
        """Where one comparator of one workload writes (under ``.bench/out``)."""
        return self.root / "out" / workload / key

    # -- running -------------------------------------------------------------------------------

    def _parse(self, comp: Comparator, pr: ProcRun) -> Sample:
        if comp.kind == "loop":
            lines = [ln for ln in pr.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
            if not lines:
                raise RuntimeError("no result line on stdout")
            res = json.loads(lines[-1][len(RESULT_PREFIX) :])
            per_proc = [p["rows"] / p["seconds"] for p in res.get("per_proc", []) if p["seconds"]]
            return Sample(
                rows=int(res["rows"]),
                wall_s=pr.wall_s,
                timed_s=float(res["seconds"]),
                peak_rss_bytes=pr.peak_rss_bytes,
                rate_override=res.get("rate"),
                per_proc_rates=per_proc if len(per_proc) > 1 else [],
                extra=res.get("extra", {}),
            )
        if comp.kind == "cli":
            path = comp.report
            if path is None:
                assert comp.output is not None
                path = report_file(comp.output)
            report = json.loads(path.read_text())
            if report["status"] != "succeeded":
                raise RuntimeError(f"run {report['status']}: {report['failure_reasons']}")
            return Sample(
                rows=int(report["rows_processed"]),
                wall_s=pr.wall_s,
                timed_s=float(report["duration_s"]),
                peak_rss_bytes=pr.peak_rss_bytes,
                extra={
                    "threads": report.get("threads"),
                    "rows_out": report.get("rows_out"),
                    "p50_ms": (report.get("batch_latency_ms") or {}).get("p50"),
                    "phases": cli_phases(report, pr),
                    "batch_size": report.get("batch_size"),
                    "auto": (report.get("execution") or {}).get("batch_size_auto"),
                    "overlap": (report.get("execution") or {}).get("overlap"),
                    "commit_s": (report.get("output_format") or {}).get("commit_s"),
                },
            )
        return Sample(rows=0, wall_s=pr.wall_s, timed_s=None, peak_rss_bytes=pr.peak_rss_bytes)

    def run_one(self, wl: WorkloadResult, comp: Comparator, rep: int) -> None:
        """Run ``comp`` once and record a sample or a failure."""
        if comp.output is not None:
            clear_output(comp.output)
        if comp.scratch is not None and (rep == 0 or comp.cold):
            shutil.rmtree(comp.scratch, ignore_errors=True)
            comp.scratch.mkdir(parents=True)
        if comp.prime and rep == 0:
            self._prime(wl, comp)
        log_path = self.root / "logs" / wl.key / f"{comp.key}-rep{rep + 1}.log"
        pr = run_measured(comp.argv, log_path=log_path, cwd=self.repo, timeout_s=RUN_TIMEOUT_S)
        if pr.leaked_pids:
            msg = f"{wl.key} {comp.key}: {len(pr.leaked_pids)} process(es) outlived the run"
            self.leaks.append(f"{msg} (pids {pr.leaked_pids}, killed)")
        try:
            if pr.timed_out:
                raise RuntimeError(f"timed out after {RUN_TIMEOUT_S:.0f} s (process group killed)")
            if pr.returncode not in comp.exit_codes:
                raise RuntimeError(f"exit code {pr.returncode}")
            sample = self._parse(comp, pr)
            sample.extra["exit"] = pr.returncode
            sample.extra["round"] = rep + 1  # per-round ratios (bench.formats)
            if comp.rows and sample.rows != comp.rows:
                raise RuntimeError(f"processed {sample.rows:,} rows, expected {comp.rows:,}")
            if comp.digest is not None and comp.output is not None and rep == 0:
                wl.digests[comp.key] = comp.digest(comp.output)
        except Exception as e:
            tail = pr.log_tail()
            wl.failures.setdefault(comp.key, []).append(f"rep {rep + 1}: {e}")
            self.log(f"  {comp.key}: FAILED ({e}); log {log_path}\n{tail}")
            return
        finally:
            if comp.output is not None and not (comp.keep_output and rep == 0):
                clear_output(comp.output)
        wl.samples.setdefault(comp.key, []).append(sample)
        rate = sample.timed_rate if comp.primary == "timed" else sample.wall_rate
        what = f"{rate:,.0f} rows/s" if comp.rows else f"{sample.wall_s:.2f} s"
        self.log(
            f"  {comp.key}: {what}, wall {sample.wall_s:.2f} s, "
            f"peak RSS {sample.peak_rss_bytes / 2**20:,.0f} MiB"
        )

    def _prime(self, wl: WorkloadResult, comp: Comparator) -> None:
        """The untimed first run of a ``prime`` comparator; a failure is the comparator's."""
        log_path = self.root / "logs" / wl.key / f"{comp.key}-prime.log"
        pr = run_measured(comp.argv, log_path=log_path, cwd=self.repo, timeout_s=RUN_TIMEOUT_S)
        if comp.output is not None:
            clear_output(comp.output)
        self.log(f"  {comp.key}: untimed first run, exit {pr.returncode}, {pr.wall_s:.2f} s")
        if pr.returncode not in comp.exit_codes or pr.timed_out:
            wl.failures.setdefault(comp.key, []).append(
                f"untimed first run: exit {pr.returncode}; log {log_path}"
            )

    def run_alternating(self, wl: WorkloadResult, repeats: int) -> None:
        """A B C ... A B C ...: each comparator ``repeats`` times, interleaved."""
        t0 = time.perf_counter()
        wl.load_before = _loadavg()
        for rep in range(repeats):
            self.log(f"[{wl.key}] round {rep + 1}/{repeats}")
            for comp in wl.comparators:
                self.run_one(wl, comp, rep)
        wl.load_after = _loadavg()
        wl.seconds = time.perf_counter() - t0


def cli_phases(report: dict[str, Any], pr: ProcRun) -> dict[str, float] | None:
    """Where one CLI run's wall time went, in seconds: ``start-up`` (process start to the
    run's start: interpreter, imports, configuration), ``planning`` (to the first shard's
    start: listing, footers, model load and dry run, lock, cluster start), ``scoring`` (first
    shard start to last shard end, the scoring window), ``finish`` (to the report's end:
    reconcile, report, ``_SUCCESS``) and ``exit`` (to the process's end: cluster shutdown)."""
    shards = [s for s in report.get("shards", []) if s.get("started_s") is not None]
    if not shards or not pr.started_epoch:
        return None
    begun = dt.datetime.fromisoformat(report["started_at"]).timestamp()
    first = min(float(s["started_s"]) for s in shards)
    last = max(float(s["finished_s"]) for s in shards)
    duration = float(report["duration_s"])
    return {
        "start-up": begun - pr.started_epoch,
        "planning": first,
        "scoring": last - first,
        "finish": duration - last,
        "exit": pr.wall_s - (begun - pr.started_epoch) - duration,
    }


def _loadavg() -> str:
    """The 1, 5 and 15-minute load averages, as /proc/loadavg writes them."""
    return " ".join(f"{x:.2f}" for x in psutil.getloadavg())


def onnx_engine_available() -> bool:
    """Whether ``--engine onnx`` can run here (the ``[onnx]`` extra installed)."""
    from pipeline.core.config import ONNX_PACKAGES, missing_packages

    return not missing_packages(ONNX_PACKAGES)


#: ``--engine onnx`` (ONNX Runtime's CPU provider) beside the torch CLI run it is compared with.
ONNX_KEY = "cli-onnx"
ONNX_LABEL = "score-catalog CLI --engine onnx (ONNX Runtime, CPU)"


def precision_flag_available(cli: str) -> bool:
    """Whether this checkout's CLI has ``run --precision`` (being added in parallel)."""
    try:
        out = subprocess.run(
            [cli, "run", "--help"], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--precision" in out.stdout


# ---------------------------------------------------------------------------------------------
# Output digests: the comparators must agree on what they wrote
# ---------------------------------------------------------------------------------------------


def _read_output(path: Path, columns: list[str]) -> pa.Table:
    # pyarrow.dataset skips _ and . names (manifest, report, rejects) as docs/output.md says.
    files = sorted(str(p) for p in path.rglob("*.parquet") if not p.name.startswith(("_", ".")))
    files = [f for f in files if "/_" not in f[len(str(path)) :]]
    return pads.dataset(files, format="parquet").to_table(columns=columns)


def score_digest(path: Path) -> dict[str, Any]:
    """Row count, id sum and score sum of a W1 output."""
    t = _read_output(path, ["item_id", "score"])
    ids = t.column("item_id").to_numpy()
    scores = t.column("score").to_numpy().astype(np.float64)
    return {
        "rows": t.num_rows,
        "id_sum": int(ids.sum()),
        "score_sum": float(scores.sum()),
        "ids_unique": len(np.unique(ids)),
    }


def _w2_arrays(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = _read_output(path, ["item_id", "label", "logits"]).sort_by("item_id")
    logits = t.column("logits").combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)
    return t.column("item_id").to_numpy(), t.column("label").to_numpy(), logits


# ---------------------------------------------------------------------------------------------
# W1: 2M rows, 16 shards, the demo MLP
# ---------------------------------------------------------------------------------------------


def _io_ceiling(
    runner: Runner, shards: list[str], out: Path, spec: dict[str, Any], cores: int, rows: int
) -> Comparator:
    """Read every shard and write it back through the same batches, no model: the I/O ceiling."""
    return Comparator(
        "io",
        "I/O ceiling (read + write, no model)",
        f"{cores} proc x 1 thread",
        BATCH,
        runner.loop_argv(
            "io_ceiling", shards=shards, out_dir=str(out), spec=spec, batch=BATCH, procs=cores
        ),
        "loop",
        rows,
        output=out,
        primary="timed",
    )


def w1(runner: Runner, data: Data, sizes: Sizes, cores: int) -> WorkloadResult:
    """The demo MLP on the 16-column catalog against every comparator of the brief."""
    spec = w1_features().to_json()
    shards = [str(p) for p in shard_files(data.w1)]
    model = str(data.w1_model)
    rows = sizes.w1_rows
    out = lambda key: runner.out_dir("w1", key)  # noqa: E731 - a short local alias
    half = f"{cores} proc x 1 thread"
    one = f"1 proc x {cores} threads"
    comps = [
        Comparator(
            "ceiling-1t",
            "model ceiling (in-memory tensors)",
            half,
            BATCH,
            runner.loop_argv(
                "model_ceiling",
                bundle=model,
                width=16,
                rows=sizes.w1_ceiling_rows,
                batch=BATCH,
                threads=1,
                procs=cores,
                precision="fp32",
            ),
            "loop",
            sizes.w1_ceiling_rows * cores,
            primary="timed",
        ),
        Comparator(
            "ceiling-1t-calls",
            "model ceiling (in-memory tensors), calls of the fastest size (256-4,096 rows)",
            half,
            None,
            runner.loop_argv(
                "model_ceiling",
                bundle=model,
                width=16,
                rows=sizes.w1_ceiling_rows,
                batch=0,
                threads=1,
                procs=cores,
                precision="fp32",
            ),
            "loop",
            sizes.w1_ceiling_rows * cores,
            primary="timed",
        ),
        Comparator(
            "ceiling-mt",
            "model ceiling (in-memory tensors)",
            one,
            BATCH,
            runner.loop_argv(
                "model_ceiling",
                bundle=model,
                width=16,
                rows=sizes.w1_ceiling_rows,
                batch=BATCH,
                threads=cores,
                procs=1,
                precision="fp32",
            ),
            "loop",
            sizes.w1_ceiling_rows,
            primary="timed",
        ),
        _io_ceiling(runner, shards, out("io"), spec, cores, rows),
        Comparator(
            "hand-1p",
            "hand-rolled loop",
            one,
            BATCH,
            runner.loop_argv(
                "hand_rolled",
                shards=shards,
                out_dir=str(out("hand-1p")),
                bundle=model,
                spec=spec,
                batch=BATCH,
                procs=1,
                threads=cores,
            ),
            "loop",
            rows,
            output=out("hand-1p"),
            digest=score_digest,
        ),
        _hand_np(runner, shards, out("hand-np"), model, spec, rows, cores),
        Comparator(
            "textbook",
            "textbook (pandas + per-row Dataset + DataLoader)",
            "1 proc, torch default threads",
            256,
            runner.loop_argv(
                "textbook", shards=shards, out_dir=str(out("textbook")), bundle=model, spec=spec
            ),
            "loop",
            rows,
            output=out("textbook"),
            digest=score_digest,
        ),
    ]
    comps += _score_catalog_w1(runner, data, sizes, BATCH)
    for key, form in (("daft", DAFT_FORM), ("daft-export", "export")):
        daft = runner.daft(
            key, shards, out(key), model, spec, rows, score_digest, peer=data.w1_peer, form=form
        )
        comps += [daft] if daft is not None else []
    wl = WorkloadResult(
        "W1",
        "W1: the demo MLP over the catalog",
        [
            f"{rows:,} rows: `item_id`, `category`, 16 float32 features (+ `label`), "
            f"{sizes.w1_shards} shards, row groups of 65,536, zstd "
            "(`pipeline.cli.demo.write_catalog`).",
            "Model: the demo 16-256-128-2 MLP (committed weights, torch.export), outputs "
            '`score = "softmax:1"` only, no pass-through.',
        ],
        comps,
    )
    runner.run_alternating(wl, sizes.repeats)
    _check_digests(wl, [c.key for c in comps if c.digest is not None])
    return wl


def _hand_np(
    runner: Runner,
    shards: list[str],
    out: Path,
    model: str,
    spec: dict[str, Any],
    rows: int,
    cores: int,
) -> Comparator:
    """The hand-rolled loop forked once per core, one torch thread each (W1 and W1 x 10)."""
    return Comparator(
        "hand-np",
        "hand-rolled loop",
        f"{cores} proc x 1 thread",
        BATCH,
        runner.loop_argv(
            "hand_rolled",
            shards=shards,
            out_dir=str(out),
            bundle=model,
            spec=spec,
            batch=BATCH,
            procs=cores,
            threads=1,
        ),
        "loop",
        rows,
        output=out,
        digest=score_digest,
    )


def _score_catalog_w1(runner: Runner, data: Data, sizes: Sizes, batch: int) -> list[Comparator]:
    """score-catalog on W1 through the CLI and through the library, at ``batch``."""
    out = lambda key: runner.out_dir("w1", key)  # noqa: E731 - a short local alias
    return [
        Comparator(
            f"cli-{batch}",
            "score-catalog CLI (--scheduler local)",
            "Dask LocalCluster",
            batch,
            runner.cli_argv(data.w1, out(f"cli-{batch}"), data.w1_model, batch),
            "cli",
            sizes.w1_rows,
            output=out(f"cli-{batch}"),
            digest=score_digest,
        ),
        Comparator(
            f"cli-{batch}-overlap",
            "score-catalog CLI, --overlap (read-ahead/write-behind threads on; auto turns "
            "them off here)",
            "Dask LocalCluster",
            batch,
            runner.cli_argv(
                data.w1,
                out(f"cli-{batch}-overlap"),
                data.w1_model,
                batch,
                extra=("--overlap",),
            ),
            "cli",
            sizes.w1_rows,
            output=out(f"cli-{batch}-overlap"),
            digest=score_digest,
        ),
        *(
            [
                _cli_auto(runner, data, sizes),
                _cli_auto(runner, data, sizes, cold=True),
                _cli_cold(runner, data, sizes),
                _cli_cold(runner, data, sizes, export=True),
            ]
            if batch == BATCH
            else []
        ),
        *(
            [_cli_onnx_w1(runner, data, sizes)]
            if batch == BATCH and onnx_engine_available()
            else []
        ),
        Comparator(
            f"lib-{batch}",
            "score-catalog library (pipeline.run)",
            "Dask LocalCluster",
            batch,
            runner.loop_argv(
                "library",
                input=str(data.w1),
                output=str(out(f"lib-{batch}")),
                model=str(data.w1_model),
                batch=batch,
            ),
            "loop",
            sizes.w1_rows,
            output=out(f"lib-{batch}"),
            digest=score_digest,
        ),
    ]


def _cli_onnx_w1(runner: Runner, data: Data, sizes: Sizes) -> Comparator:
    """``cli-4096`` with ``--engine onnx``: the program's ONNX export is kept in the runner's
    cache like the torch program (exported in the warm-up run), so both compare warm."""
    out = runner.out_dir("w1", ONNX_KEY)
    return Comparator(
        ONNX_KEY,
        ONNX_LABEL,
        "Dask LocalCluster",
        BATCH,
        runner.cli_argv(data.w1, out, data.w1_model, BATCH, extra=("--engine", "onnx")),
        "cli",
        sizes.w1_rows,
        output=out,
        digest=score_digest,
    )


def _cli_auto(runner: Runner, data: Data, sizes: Sizes, *, cold: bool = False) -> Comparator:
    """``--batch-size auto`` with a cache folder of its own. Cached (``cli-auto``): an untimed
    first run makes the choice, every counted run reuses it, as nights 2+ do. ``cold``
    (``cli-auto-cold``): the folder emptied before every run, as a fresh container's first night
    (the sweep and the program file's load paid each time); its like is ``cli-4096-cold``."""
    return _cli_own_cache(
        runner,
        data,
        sizes,
        "cli-auto-cold" if cold else "cli-auto",
        "score-catalog CLI --batch-size auto, "
        + (
            "empty cache in every run (the sweep paid every time)"
            if cold
            else "its choice cached (made by an untimed first run)"
        ),
        "auto",
        cold=cold,
        prime=not cold,
    )


def _cli_cold(runner: Runner, data: Data, sizes: Sizes, *, export: bool = False) -> Comparator:
    """The CLI with an empty cache folder in every run, as in a fresh container each night: the
    bundle is loaded from its program file (pipeline.model.sidecar, written by save_bundle) or,
    ``export``, from a copy without one, by torch.export's loader (pipeline.model.programcache).
    The other CLI runs reuse the program the warm-up run cached, as every later night on one
    machine does."""
    return _cli_own_cache(
        runner,
        data,
        sizes,
        "cli-4096-cold-export" if export else "cli-4096-cold",
        "score-catalog CLI, empty program cache, "
        + (
            "bundle without its program file (torch.export's loader in every run)"
            if export
            else "bundle with its program file (as save_bundle writes it)"
        ),
        BATCH,
        cold=True,
        model=data.w1_model_export if export else data.w1_model,
    )


def _cli_own_cache(
    runner: Runner,
    data: Data,
    sizes: Sizes,
    key: str,
    label: str,
    batch: int | str,
    *,
    cold: bool,
    model: Path | None = None,
    prime: bool = False,
) -> Comparator:
    """The CLI on W1 (the bundle ``model``, by default W1's) with a cache folder of its own
    (``XDG_CACHE_HOME``), emptied before the first run or, ``cold``, before every run."""
    out = runner.out_dir("w1", key)
    cache = runner.out_dir("w1", f"{key}-cache")
    return Comparator(
        key,
        label,
        "Dask LocalCluster",
        batch if isinstance(batch, int) else None,
        [
            "env",
            f"XDG_CACHE_HOME={cache}",
            *runner.cli_argv(data.w1, out, model or data.w1_model, batch),
        ],
        "cli",
        sizes.w1_rows,
        output=out,
        digest=score_digest,
        scratch=cache,
        cold=cold,
        prime=prime,
    )


def w1x10(runner: Runner, data: Data, sizes: Sizes, cores: int) -> WorkloadResult:
    """W1 with ten times the rows, through the CLI beside the best hand-rolled layout and Daft:
    with W1's own run, the marginal rate ``(rows2 - rows1) / (t2 - t1)`` separates the steady
    state from the fixed costs, and the scoring window is read against W1's limit."""
    assert data.w1x10 is not None
    spec = w1_features().to_json()
    shards = [str(p) for p in shard_files(data.w1x10)]
    model = str(data.w1_model)
    rows = sizes.w1x10_rows
    out = lambda key: runner.out_dir("w1x10", key)  # noqa: E731 - a short local alias
    comps = [
        Comparator(
            "cli-4096",
            "score-catalog CLI (--scheduler local)",
            "Dask LocalCluster",
            BATCH,
            runner.cli_argv(data.w1x10, out("cli-4096"), data.w1_model, BATCH),
            "cli",
            rows,
            output=out("cli-4096"),
            digest=score_digest,
        ),
        _hand_np(runner, shards, out("hand-np"), model, spec, rows, cores),
    ]
    daft = runner.daft(
        "daft", shards, out("daft"), model, spec, rows, score_digest, peer=data.w1_peer
    )
    comps += [daft] if daft is not None else []
    wl = WorkloadResult(
        "W1X10",
        "W1 x 10: the steady state apart from the fixed costs",
        [
            f"{rows:,} rows, the W1 schema and model, {sizes.w1_shards} shards "
            "(ten times W1's rows per shard).",
        ],
        comps,
    )
    runner.run_alternating(wl, sizes.repeats)
    _check_digests(wl, [c.key for c in comps if c.digest is not None])
    return wl


def w1_big_batch_cost(wl: WorkloadResult, repeats: int) -> float | None:
    """Projected seconds for the batch-65,536 runs: as long as the batch-4096 ones took."""
    walls = [wl.wall("cli-4096"), wl.wall("lib-4096")]
    if any(w is None for w in walls):
        return None
    return repeats * sum(w.median for w in walls if w is not None)


def w1_big_batch(runner: Runner, data: Data, sizes: Sizes, wl: WorkloadResult) -> None:
    """score-catalog at batch 65,536 on W1, added to W1's table ("if time allows").

    Runs after the other suites, alternating between its two comparators only, so the
    comparison with batch 4096 spans a longer stretch of time than the rest of the table.
    """
    comps = [
        c
        for c in _score_catalog_w1(runner, data, sizes, BIG_BATCH)
        if not c.key.endswith("-overlap")
    ]
    part = WorkloadResult(wl.key, wl.title, [], comps)
    runner.run_alternating(part, sizes.repeats)
    wl.comparators += comps
    wl.samples.update(part.samples)
    wl.failures.update(part.failures)
    wl.digests.update(part.digests)
    wl.seconds += part.seconds
    wl.notes.append(
        f"Batch {BIG_BATCH:,} runs were measured after the other suites (alternating between "
        "themselves), because the brief asks for them only if time allows."
    )
    wl.checks.clear()
    _check_digests(wl, [c.key for c in wl.comparators if c.digest is not None])


def _check_digests(wl: WorkloadResult, keys: list[str]) -> None:
    got = {k: wl.digests[k] for k in keys if k in wl.digests}
    if len(got) < 2:
        wl.checks.append("output digests: fewer than two outputs to compare")
        return
    ref_key, ref = next(iter(got.items()))
    ok = True
    for k, d in got.items():
        same_rows = d["rows"] == ref["rows"] == d["ids_unique"] and d["id_sum"] == ref["id_sum"]
        close = abs(d["score_sum"] - ref["score_sum"]) <= 1e-4 * max(1.0, abs(ref["score_sum"]))
        if not (same_rows and close):
            ok = False
            wl.checks.append(f"MISMATCH: {k} wrote {d} but {ref_key} wrote {ref}")
    if ok:
        wl.checks.append(
            f"all {len(got)} scoring outputs agree ({', '.join(got)}): {ref['rows']:,} rows, "
            f"each id once, same id sum, score sums within 1e-4 relative "
            f"({ref['score_sum']:,.3f})"
        )


# ---------------------------------------------------------------------------------------------
# W2: compute-heavy, 64-1024-1024-8 over a 64-float embedding
# ---------------------------------------------------------------------------------------------


def w2(runner: Runner, data: Data, sizes: Sizes, cores: int, precision: bool) -> WorkloadResult:
    """A compute-bound model: score-catalog against the model ceiling, and bf16 against fp32.

    Without bf16 instructions torch emulates bf16 at roughly a tenth of fp32's speed, and
    scoring all of W2 that way three times would take most of the bench's 15 minutes. The
    bf16 pair (and the bf16 ceiling) then runs on an eighth of W2's rows, with an fp32 run over
    the same rows beside it, so the ratio still compares like with like.
    """
    spec = w2_features().to_json()
    shards = [str(p) for p in shard_files(data.w2)]
    model = str(data.w2_model)
    rows = sizes.w2_rows
    native = cpu_has_native_bf16()
    out = lambda key: runner.out_dir("w2", key)  # noqa: E731 - a short local alias
    half = f"{cores} proc x 1 thread"

    def ceiling(key: str, threads: int, procs: int, prec: str, n: int) -> Comparator:
        layout = half if procs > 1 else f"1 proc x {threads} threads"
        return Comparator(
            key,
            f"model ceiling {prec}" + (" (autocast)" if prec == "bf16" else ""),
            layout,
            BATCH,
            runner.loop_argv(
                "model_ceiling",
                bundle=model,
                width=64,
                rows=n,
                batch=BATCH,
                threads=threads,
                procs=procs,
                precision=prec,
            ),
            "loop",
            n * procs,
            primary="timed",
        )

    def cli(key: str, label: str, input_: Path, n: int, extra: tuple[str, ...] = ()) -> Comparator:
        return Comparator(
            key,
            label,
            "Dask LocalCluster",
            BATCH,
            runner.cli_argv(input_, out(key), data.w2_model, BATCH, extra=extra),
            "cli",
            n,
            output=out(key),
            digest=ids_digest,
            keep_output=key in pair,
        )

    bf16_rows = sizes.w2_ceiling_rows if native else min(sizes.w2_ceiling_rows, 3 * BATCH)
    part = sizes.w2_part_rows
    pair = ("cli-fp32", "cli-bf16") if native else ("cli-fp32-part", "cli-bf16-part")
    comps = [
        ceiling("ceiling-1t", 1, cores, "fp32", sizes.w2_ceiling_rows),
        ceiling("ceiling-mt", cores, 1, "fp32", sizes.w2_ceiling_rows),
        ceiling("ceiling-bf16-1t", 1, cores, "bf16", bf16_rows),
        _io_ceiling(runner, shards, out("io"), spec, cores, rows),
        cli("cli-fp32", "score-catalog CLI fp32", data.w2, rows),
    ]
    daft = runner.daft(
        "daft", shards, out("daft"), model, spec, rows, ids_digest, peer=data.w2_peer
    )
    comps += [daft] if daft is not None else []
    if onnx_engine_available():
        comps.append(cli(ONNX_KEY, ONNX_LABEL, data.w2, rows, ("--engine", "onnx")))
    bf16 = ("--precision", "bf16")
    if precision and native:
        comps.append(cli("cli-bf16", "score-catalog CLI --precision bf16", data.w2, rows, bf16))
    elif precision:
        comps.append(cli(pair[0], "score-catalog CLI fp32, W2 part", data.w2_part, part))
        comps.append(
            cli(pair[1], "score-catalog CLI --precision bf16, W2 part", data.w2_part, part, bf16)
        )
    wl = WorkloadResult(
        "W2",
        "W2: compute-heavy MLP over an embedding column",
        [
            f"{rows:,} rows: `item_id` + `embedding` (`fixed_size_list<float32>[64]`), "
            f"{sizes.w2_shards} shards, row groups of 65,536, zstd.",
            "Model: seeded, untrained 64-1024-1024-8 MLP (torch.export, dynamic batch); outputs "
            '`label = "argmax"`, `logits = "raw"`. Model ceilings run '
            f"{sizes.w2_ceiling_rows:,} in-memory rows per process "
            f"(bf16: {bf16_rows:,}).",
        ],
        comps,
    )
    wl.meta["bf16_pair"] = pair
    wl.meta["bf16_native"] = native
    if not precision:
        wl.notes.append(
            "bf16 vs fp32 through score-catalog: not available (`score-catalog run --help` has "
            "no `--precision` in this checkout); skipped."
        )
    elif not native:
        wl.notes.append(
            "This CPU has no bf16 instructions (no avx512_bf16 or amx_bf16 in /proc/cpuinfo), "
            "so torch emulates bf16. To keep the bench within its time budget the bf16 pair "
            f"runs on a part of W2 ({part:,} rows in 2 shards, `{pair[0]}` vs `{pair[1]}`) and "
            f"the bf16 ceiling on {bf16_rows:,} rows per process."
        )
    runner.run_alternating(wl, sizes.repeats)
    _compare_precisions(wl, out(pair[0]), out(pair[1]), precision)
    return wl


def ids_digest(path: Path) -> dict[str, Any]:
    """Row count and distinct ids of an output (each input row must appear once)."""
    ids = _read_output(path, ["item_id"]).column("item_id").to_numpy()
    return {"rows": len(ids), "ids_unique": len(np.unique(ids))}


def _compare_precisions(wl: WorkloadResult, fp32: Path, bf16: Path, precision: bool) -> None:
    for key, d in wl.digests.items():
        if d["rows"] != d["ids_unique"]:
            wl.checks.append(
                f"MISMATCH: {key} wrote {d['rows']:,} rows but {d['ids_unique']:,} ids"
            )
        else:
            wl.checks.append(f"{key} (round 1): {d['rows']:,} rows, each id once")
    try:
        if precision and (fp32 / "_SUCCESS").exists() and (bf16 / "_SUCCESS").exists():
            ids_a, lab_a, log_a = _w2_arrays(fp32)
            ids_b, lab_b, log_b = _w2_arrays(bf16)
            if not np.array_equal(ids_a, ids_b):
                wl.checks.append("MISMATCH: fp32 and bf16 outputs hold different ids")
            else:
                agree = float((lab_a == lab_b).mean())
                diff = float(np.abs(log_a - log_b).max())
                wl.checks.append(
                    f"bf16 vs fp32 outputs (round 1): {len(ids_a):,} rows each; argmax labels "
                    f"agree on {agree:.4%} of rows; max |logit difference| {diff:.3g} "
                    "(untrained model: near-tied logits flip easily)"
                )
    finally:
        shutil.rmtree(fp32, ignore_errors=True)
        shutil.rmtree(bf16, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# W3: memory at 1x and 10x rows in one shard
# ---------------------------------------------------------------------------------------------


def w3(runner: Runner, data: Data, sizes: Sizes) -> WorkloadResult:
    """Peak RSS of the CLI's whole process tree, and of a bare pyarrow loop, at 1x and 10x."""
    cols = w1_features().read_columns
    comps: list[Comparator] = []
    for scale, path, rows in (("1x", data.w3_1x, sizes.w3_rows), ("10x", data.w3_10x, 0)):
        n = rows or 10 * sizes.w3_rows
        comps.append(
            Comparator(
                f"cli-{scale}",
                f"score-catalog CLI, {scale}",
                "Dask LocalCluster",
                BATCH,
                runner.cli_argv(path, runner.out_dir("w3", f"cli-{scale}"), data.w1_model, BATCH),
                "cli",
                n,
                output=runner.out_dir("w3", f"cli-{scale}"),
            )
        )
        shard = str(shard_files(path)[0])
        for pre in (True, False):
            comps.append(
                Comparator(
                    f"pa-prebuffer-{str(pre).lower()}-{scale}",
                    f"pyarrow iter_batches pre_buffer={pre}, {scale}",
                    "1 proc",
                    65_536,
                    runner.loop_argv(
                        "pyarrow_loop", shard=shard, pre_buffer=pre, columns=cols, batch=65_536
                    ),
                    "loop",
                    n,
                )
            )
    wl = WorkloadResult(
        "W3",
        "W3: memory, 1x and 10x rows in one shard",
        [
            f"W1's schema in ONE shard: {sizes.w3_rows:,} rows (1x) and {10 * sizes.w3_rows:,} "
            "rows (10x), row groups of 65,536; the W1 bundle, batch 4096.",
            "Peak RSS: the sum of RSS over the process and all its descendants (CLI, Dask "
            "nanny and worker processes), sampled from /proc every 50 ms. Sum-of-RSS counts "
            "pages shared between processes once per process, so it is an upper bound.",
        ],
        comps,
    )
    runner.run_alternating(wl, sizes.repeats)
    return wl


# ---------------------------------------------------------------------------------------------
# The 1,000-row job
# ---------------------------------------------------------------------------------------------


def tiny(runner: Runner, data: Data, sizes: Sizes) -> WorkloadResult:
    """A 1,000-row job end to end next to a bare import of the stack."""
    comps = []
    for sched in ("local", "sync"):
        out = runner.out_dir("tiny", f"cli-{sched}")
        comps.append(
            Comparator(
                f"cli-{sched}",
                f"score-catalog run --scheduler {sched}",
                "Dask LocalCluster" if sched == "local" else "in-process",
                BATCH,
                runner.cli_argv(data.tiny, out, data.w1_model, BATCH, scheduler=sched),
                "cli",
                sizes.tiny_rows,
                output=out,
            )
        )
    for key, model, how in (
        ("cli-sync-cold", data.w1_model, "the bundle's program file"),
        ("cli-sync-cold-export", data.w1_model_export, "torch.export's loader"),
    ):
        out = runner.out_dir("tiny", key)
        cache = runner.out_dir("tiny", f"{key}-cache")
        comps.append(
            Comparator(
                key,
                f"score-catalog run --scheduler sync, empty program cache ({how})",
                "in-process",
                BATCH,
                [
                    "env",
                    f"XDG_CACHE_HOME={cache}",
                    *runner.cli_argv(data.tiny, out, model, BATCH, scheduler="sync"),
                ],
                "cli",
                sizes.tiny_rows,
                output=out,
                scratch=cache,
                cold=True,
            )
        )
    comps.append(
        Comparator(
            "import",
            'python -c "import torch, pyarrow, dask.distributed"',
            "1 proc",
            None,
            [runner.python, "-c", "import torch, pyarrow, dask.distributed"],
            "command",
            0,
        )
    )
    comps.append(
        Comparator(
            "import-tp",
            'python -c "import torch, pyarrow"',
            "1 proc",
            None,
            [runner.python, "-c", "import torch, pyarrow"],
            "command",
            0,
        )
    )
    comps.append(
        Comparator(
            "help", "score-catalog --help", "1 proc", None, [runner.cli, "--help"], "command", 0
        )
    )
    wl = WorkloadResult(
        "TINY",
        f"A {sizes.tiny_rows:,}-row job end to end",
        [f"{sizes.tiny_rows:,} rows in one shard, the W1 bundle, through the CLI."],
        comps,
    )
    runner.run_alternating(wl, sizes.repeats)
    return wl
