"""Machine facts and the markdown report (BENCHMARKS.md and stdout).

Every number in the report comes from the :class:`~bench.suites.WorkloadResult` objects of this
run; nothing here is typed by hand.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.delta import delta_section
from bench.incremental import incremental_section
from bench.mdtable import Column, markdown_table
from bench.stats import Summary, ratio
from bench.suites import DAFT_FORMS, FLOOR_TARGET, WorkloadResult
from bench.workloads import Sizes, cpu_info

MIB = 2**20
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCH_NUM_THREADS")


def available_cores() -> int:
    """Cores this process may run on (what the pipeline sizes itself to)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _mem_total_gib() -> float:
    return float(psutil.virtual_memory().total) / 2**30


def _git(repo: Path, *args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def machine_facts(repo: Path) -> dict[str, str]:
    """What the figures were measured on, and with which versions."""
    import dask
    import distributed
    import numpy
    import pandas
    import pyarrow
    import torch

    model, flags = cpu_info()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    simd = [f for f in wanted if f in flags]
    # A ratio measured on one CPU class does not carry to another (issue 25: 1.44x Daft with
    # AMX, 0.97x without): say outright whether this one has AMX.
    if flags:
        simd.append("AMX" if any(f.startswith("amx") for f in flags) else "no AMX")
    commit = _git(repo, "rev-parse", "--short=12", "HEAD")
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    env = ", ".join(f"{k}={os.environ[k]}" for k in THREAD_ENV if k in os.environ)
    return {
        "date (UTC)": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "CPU": model,
        "SIMD flags": ", ".join(simd) or "unknown (no /proc/cpuinfo)",
        "cores (affinity / os.cpu_count)": f"{available_cores()} / {os.cpu_count()}",
        "RAM": f"{_mem_total_gib():.1f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "pandas": pandas.__version__,
        "numpy": numpy.__version__,
        "dask / distributed": f"{dask.__version__} / {distributed.__version__}",
        "git commit": commit + (" (tracked files modified)" if dirty else ""),
        "thread variables": env or "none set (OMP_NUM_THREADS etc. unset)",
        "transparent huge pages": _thp(),
        "program cache": "the CLI's runs reuse the bundle it cached in an earlier run (the "
        "warm-up run for W1, round 1 for W2), as every night after a model's first does; the "
        "`-cold` comparators empty it before every run (pipeline.model.programcache) and load "
        "the bundle from its program file (pipeline.model.sidecar, as save_bundle writes it), "
        "the `-cold-export` ones from a copy without it (torch.export's loader)",
    }


def _thp() -> str:
    """The kernel's THP mode, and who asks torch for huge pages in this bench."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        mode = text.split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        mode = "unknown"
    asked = os.environ.get("THP_MEM_ALLOC_ENABLE")
    who = (
        f"THP_MEM_ALLOC_ENABLE={asked} for every comparator"
        if asked is not None
        else "the score-catalog CLI sets THP_MEM_ALLOC_ENABLE=1 for itself; the other "
        "comparators (library, hand-rolled, Daft, ceilings) run without it"
    )
    return f"kernel mode {mode}; {who}"


# ---------------------------------------------------------------------------------------------
# Formatting helpers
# ---------------------------------------------------------------------------------------------


def _rate(s: Summary | None) -> str:
    return "—" if s is None else f"{s.median:,.0f}"


def _range(s: Summary | None, scale: float = 1.0, fmt: str = ",.0f") -> str:
    if s is None:
        return "—"
    return f"{s.lo / scale:{fmt}}–{s.hi / scale:{fmt}}"


def _seconds(s: Summary | None) -> str:
    return "—" if s is None else f"{s.median:.2f}"


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def _mib(s: Summary | None) -> str:
    return "—" if s is None else f"{s.median / MIB:,.0f}"


# ---------------------------------------------------------------------------------------------
# Derived figures
# ---------------------------------------------------------------------------------------------


@dataclass
class Limit:
    """The machine's limit: cores / (model s/row at 1 thread + read-and-write s/row)."""

    cores: int
    model_rate_1t: float  # rows/s of one single-threaded process, all cores busy
    io_rate_1p: float  # rows/s of one single-threaded I/O process, all cores busy
    s_model: float = field(init=False)
    s_io: float = field(init=False)
    rows_per_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.s_model = 1.0 / self.model_rate_1t
        self.s_io = 1.0 / self.io_rate_1p
        self.rows_per_s = self.cores / (self.s_model + self.s_io)


def machine_limit(wl: WorkloadResult, cores: int, model_key: str = "ceiling-1t") -> Limit | None:
    """From the ``ceiling-1t`` (or ``model_key``) and ``io`` comparators' per-process rates
    (medians)."""
    model = wl.per_proc(model_key)
    io = wl.per_proc("io")
    if cores == 1:  # one process: its timed rate is the per-process rate
        model, io = wl.timed(model_key), wl.timed("io")
    if model is None or io is None or model.median <= 0 or io.median <= 0:
        return None
    return Limit(cores, model.median, io.median)


def hand_best(wl: WorkloadResult) -> tuple[str, Summary] | None:
    """The hand-rolled layout with the higher median (end to end)."""
    cands = [(k, s) for k in ("hand-1p", "hand-np") if (s := wl.primary(k)) is not None]
    return max(cands, key=lambda ks: ks[1].median) if cands else None


def _label(wl: WorkloadResult, key: str) -> str:
    c = next((c for c in wl.comparators if c.key == key), None)
    return f"{c.label} [{c.layout}]" if c is not None else key


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def _throughput_table(
    wl: WorkloadResult, refs: list[tuple[str, Callable[[Summary | None], float | None]]]
) -> list[str]:
    """One row per comparator: rates, memory, and the ratio of its rate to each reference."""
    rows = []
    for c in wl.comparators:
        failed = " **FAILED**" if c.key in wl.failures else ""
        rows.append(
            {
                "comparator": f"`{c.key}` {c.label}{failed}",
                "layout": c.layout,
                "batch": c.batch,
                "prim": wl.primary(c.key),
                "basis": "process wall" if c.primary == "wall" else "timed region",
                "timed": wl.timed(c.key),
                "rss": wl.rss(c.key),
            }
        )
    columns = [
        Column("comparator", "comparator"),
        Column("layout", "layout"),
        Column("batch", "batch", lambda b: f"{b:,}" if b else "—"),
        Column("n", "prim", lambda s: str(s.n if s else 0)),
        Column("rows/s (median)", "prim", _rate),
        Column("min–max", "prim", _range),
        Column("basis", "basis"),
        Column("timed-region rows/s", "timed", _rate),
        Column("peak RSS MiB", "rss", _mib),
        *[Column(name, "prim", lambda s, f=f: _x(f(s))) for name, f in refs],
    ]
    return markdown_table(rows, columns)


def _w1_section(wl: WorkloadResult, cores: int) -> tuple[list[str], list[str]]:
    lim = machine_limit(wl, cores)
    best = hand_best(wl)
    ceil = wl.primary("ceiling-1t")
    refs: list[tuple[str, Callable[[Summary | None], float | None]]] = [
        ("÷ limit", lambda s: None if s is None or lim is None else s.median / lim.rows_per_s),
        ("÷ hand-rolled best", lambda s: ratio(s, best[1] if best else None)),
        (f"÷ model ceiling ({cores}x1)", lambda s: ratio(s, ceil)),
    ]
    lines = [f"## {wl.title}", "", *[f"- {d}" for d in wl.description], ""]
    lines += _throughput_table(wl, refs)
    lines += [""]
    for note in wl.notes:
        lines += [note, ""]
    summary: list[str] = []
    lines += ["### The machine's limit", ""]
    if lim is None:
        lines.append("Not computed: the model or I/O ceiling did not run.")
    else:
        lines += [
            "`limit = cores / (model seconds per row at 1 thread + read-and-write seconds per "
            "row)`, with every input measured in this run with all cores busy "
            f"({cores} single-threaded processes at once):",
            "",
            f"- cores = {cores}",
            f"- model s/row at 1 thread = 1 / {lim.model_rate_1t:,.0f} rows/s "
            f"(median per-process rate of `ceiling-1t`) = {lim.s_model * 1e6:.3f} µs",
            f"- read-and-write s/row = 1 / {lim.io_rate_1p:,.0f} rows/s "
            f"(median per-process rate of `io`) = {lim.s_io * 1e6:.3f} µs",
            f"- **limit = {cores} / ({lim.s_model * 1e6:.3f} + {lim.s_io * 1e6:.3f}) µs "
            f"= {lim.rows_per_s:,.0f} rows/s**",
        ]
        fast = machine_limit(wl, cores, "ceiling-1t-calls")
        if fast is not None:
            lines += [
                f"- with the model called at its fastest size on this CPU (`ceiling-1t-calls`, "
                f"as a run splits its batches: 1 / {fast.model_rate_1t:,.0f} rows/s = "
                f"{fast.s_model * 1e6:.3f} µs): **{fast.rows_per_s:,.0f} rows/s**, the "
                "stricter limit",
            ]
    lines.append("")
    cli = wl.primary("cli-4096")
    lib_t = wl.timed("lib-4096")
    if cli is not None and lim is not None:
        head = cli.median / lim.rows_per_s
        lines.append(
            f"**Headline: score-catalog CLI (batch 4096, end to end) = {cli.median:,.0f} rows/s "
            f"= {head:.2f}x the machine's limit.**"
        )
        summary.append(
            f"W1 headline: score-catalog CLI {cli.median:,.0f} rows/s = **{head:.2f}x** the "
            f"machine's limit ({lim.rows_per_s:,.0f} rows/s)."
        )
    if cli is not None and best is not None:
        floor = cli.median / best[1].median
        verdict = "MET" if floor >= FLOOR_TARGET else "NOT MET"
        text = (
            f"Floor target (CLI >= {FLOOR_TARGET:.2f}x the best hand-rolled layout, both end to "
            f"end): CLI {cli.median:,.0f} / {_label(wl, best[0])} {best[1].median:,.0f} "
            f"= **{floor:.2f}x: {verdict}**."
        )
        lines += ["", text]
        summary.append(text)
        hand_t = wl.timed(best[0])
        if lib_t is not None and hand_t is not None:
            lines.append(
                f"Timed regions (after the interpreter's start-up and imports): library "
                f"`pipeline.run` {lib_t.median:,.0f} rows/s vs hand-rolled {hand_t.median:,.0f} "
                f"rows/s = {lib_t.median / hand_t.median:.2f}x."
            )
    summary += _vs_daft(wl, "cli-4096", lines)
    summary += _vs_onnx(wl, "cli-4096", lines)
    daft = wl.primary("daft")
    for key, how in (
        ("cli-4096-cold", "the bundle loaded from its program file, as save_bundle writes it"),
        ("cli-4096-cold-export", "a bundle without one, loaded by torch.export in every run"),
    ):
        cold = wl.primary(key)
        if cold is None or cli is None:
            continue
        text = (
            f"W1 with an empty program cache in every run (a fresh container each night; "
            f"{how}): {cold.median:,.0f} rows/s = {cold.median / cli.median:.2f}x the cached runs"
            + (f", {cold.median / daft.median:.2f}x Daft" if daft is not None else "")
            + "."
        )
        lines += ["", text]
        summary.append(text)
    summary += _auto(wl, lines)
    forced = wl.primary("cli-4096-overlap")
    if cli is not None and forced is not None:
        chose = {s.extra.get("overlap") for s in wl.samples.get("cli-4096", [])}
        said = {True: "on", False: "off"}
        text = (
            f"W1 overlap = auto (the default; it chose "
            f"{', '.join(said.get(c, '?') for c in chose)}) against `--overlap`: "
            f"{cli.median:,.0f} vs {forced.median:,.0f} rows/s end to end = "
            f"**{cli.median / forced.median:.2f}x**."
        )
        lines += ["", text]
        summary.append(text)
    phases = _phases(
        wl,
        [
            "cli-4096",
            "cli-4096-overlap",
            "cli-4096-cold",
            "cli-4096-cold-export",
            "cli-auto",
            "cli-auto-cold",
            "cli-onnx",
        ],
    )
    if phases:
        lines += ["", "### Where the time goes", "", *phases]
        rate = _window_rate(wl, "cli-4096")
        if rate is not None and lim is not None:
            fast = machine_limit(wl, cores, "ceiling-1t-calls")
            text = (
                f"W1 scoring window (first shard start to last shard end, CLI): {rate:,.0f} "
                f"rows/s = **{rate / lim.rows_per_s:.2f}x** the machine's limit"
                + (
                    f" ({rate / fast.rows_per_s:.2f}x the stricter limit, the model at its "
                    "fastest call size)"
                    if fast is not None
                    else ""
                )
                + "."
            )
            lines += [text, ""]
            summary.append(text)
    lines += ["", "### Checks", "", *[f"- {c}" for c in wl.checks], ""]
    return lines, summary


PHASES = ("start-up", "planning", "scoring", "finish", "exit")


def _window_rate(wl: WorkloadResult, key: str) -> float | None:
    """Rows/s of ``key``'s scoring window (first shard start to last shard end), the median
    over its runs; None without phases."""
    window = [
        p["scoring"]
        for smp in wl.samples.get(key, [])
        if (p := smp.extra.get("phases")) and p["scoring"] > 0
    ]
    rows = next((c.rows for c in wl.comparators if c.key == key), 0)
    return rows / float(np.median(window)) if window and rows else None


def _phases(wl: WorkloadResult, keys: list[str]) -> list[str]:
    """Median seconds per phase of each CLI comparator's runs (suites.cli_phases): where the
    process's wall time goes, so the fixed costs and the scoring window are read apart."""
    rows = []
    for key in keys:
        got = [p for s in wl.samples.get(key, []) if (p := s.extra.get("phases"))]
        if not got:
            continue
        med = {ph: float(np.median([p[ph] for p in got])) for ph in PHASES}
        wall = float(np.median([s.wall_s for s in wl.samples[key]]))
        rows.append((key, med, wall, len(got)))
    if not rows:
        return []
    lines = [
        "Where each CLI run's wall time goes (medians, seconds): **start-up** = process start "
        "to the run's start (interpreter, imports, configuration); **planning** = to the first "
        "shard's start (listing, footers, model load and dry run, lock, cluster start); "
        "**scoring** = first shard start to last shard end; **finish** = reconcile, report, "
        "`_SUCCESS`; **exit** = to the process's end.",
        "",
        "| comparator | " + " | ".join(PHASES) + " | wall | n |",
        "|---|" + "---:|" * (len(PHASES) + 2),
    ]
    for key, med, wall, n in rows:
        cells = " | ".join(f"{med[ph]:.2f}" for ph in PHASES)
        lines.append(f"| `{key}` | {cells} | {wall:.2f} | {n} |")
    return [*lines, ""]


AUTO_CACHED_TARGET = 0.98  # issue 25: never slower than the default beyond noise, cached
AUTO_COLD_TARGET = 0.90  # and by at most 10% on its first run (the sweep paid)


def _auto(wl: WorkloadResult, lines: list[str]) -> list[str]:
    """``--batch-size auto`` against the default (batch 4,096) measured beside it: cached (an
    untimed first run made the choice) against ``cli-4096``; with an empty cache in every run
    (the sweep paid) against ``cli-4096-cold``, which pays the same program-file load."""
    out: list[str] = []
    samples = [*wl.samples.get("cli-auto", []), *wl.samples.get("cli-auto-cold", [])]
    chosen = sorted({int(s.extra["batch_size"]) for s in samples if s.extra.get("batch_size")})
    sweeps = [
        float(a["sweep_s"])
        for s in wl.samples.get("cli-auto-cold", [])
        if (a := s.extra.get("auto")) and not a.get("cached") and "sweep_s" in a
    ]
    for key, ref_key, target, what in (
        ("cli-auto", "cli-4096", AUTO_CACHED_TARGET, "its choice cached"),
        ("cli-auto-cold", "cli-4096-cold", AUTO_COLD_TARGET, "an empty cache in every run"),
    ):
        auto, ref = wl.primary(key), wl.primary(ref_key)
        if auto is None or ref is None:
            continue
        gain = auto.median / ref.median
        text = (
            f"W1 `--batch-size auto`, {what}: {auto.median:,.0f} vs {ref.median:,.0f} rows/s "
            f"for the default batch 4,096 (`{ref_key}`) end to end = **{gain:.2f}x** "
            f"(target >= {target:.2f}x: {'MET' if gain >= target else 'NOT MET'})"
        )
        if key == "cli-auto-cold" and sweeps:
            text += f"; the sweep took {float(np.median(sweeps)):.2f} s"
        out.append(text + f"; chose {', '.join(f'{c:,}' for c in chosen) or '?'}.")
    for text in out:
        lines += ["", text]
    return out


def _vs_onnx(wl: WorkloadResult, ours: str, lines: list[str]) -> list[str]:
    """``--engine onnx`` against the torch CLI run beside it, and the rule it is adopted by."""
    onnx, cli = wl.primary("cli-onnx"), wl.primary(ours)
    if onnx is None or cli is None:
        return []
    pa_ms, pb_ms = _p50(wl, ours), _p50(wl, "cli-onnx")
    gain = onnx.median / cli.median
    text = (
        f"{wl.key} `--engine onnx` (ONNX Runtime, CPU) vs torch (`{ours}`): {onnx.median:,.0f} "
        f"vs {cli.median:,.0f} rows/s end to end = **{gain:.2f}x**, "
        f"{_x(ratio(wl.timed('cli-onnx'), wl.timed(ours)))} inside the run"
    )
    if pa_ms is not None and pb_ms is not None:
        text += f"; model call p50 {pb_ms.median:.1f} vs {pa_ms.median:.1f} ms per batch"
    text += (
        f" (docs/tuning.md: worth choosing for this model on this CPU at >= 1.15x: "
        f"{'yes' if gain >= 1.15 else 'no'})."
    )
    lines += ["", text]
    return [text]


def _daft_form(wl: WorkloadResult, key: str) -> str:
    """How a Daft comparator loaded the model, as its runs said."""
    forms = {s.extra.get("form") for s in wl.samples.get(key, [])} - {None}
    return ", ".join(DAFT_FORMS.get(f, f) for f in sorted(forms)) or "form not recorded"


def _vs_daft(wl: WorkloadResult, ours: str, lines: list[str]) -> list[str]:
    """The strongest peer beside us, in its best form (``daft``), process to process and timed
    region to timed region; and, where measured, Daft loading the bundle's torch.export program
    in every UDF instance (``daft-export``), which is not the fair comparison."""
    daft, cli = wl.primary("daft"), wl.primary(ours)
    if daft is None or cli is None:
        return []
    daft_t, cli_t = wl.timed("daft"), wl.timed(ours)
    text = (
        f"{wl.key} vs Daft (native runner, same model and shards; Daft's best form here: "
        f"{_daft_form(wl, 'daft')}): score-catalog CLI {cli.median:,.0f} vs Daft "
        f"{daft.median:,.0f} rows/s process to process = **{cli.median / daft.median:.2f}x**; "
        f"timed regions (our report's duration vs Daft's read-score-write) "
        f"{_x(ratio(cli_t, daft_t))}."
    )
    lines += ["", text]
    out = [text]
    export = wl.primary("daft-export")
    if export is not None:
        pair = _pairwise(wl, "daft", "daft-export")
        more = (
            f"; Daft's best form / its export form pair by pair: median {pair:.2f}x"
            if pair is not None
            else ""
        )
        text = (
            f"{wl.key} vs Daft loading {_daft_form(wl, 'daft-export')} (not the fair form): "
            f"CLI {cli.median:,.0f} vs {export.median:,.0f} rows/s = "
            f"{cli.median / export.median:.2f}x{more}."
        )
        lines += ["", text]
        out.append(text)
    return out


def _pairwise(wl: WorkloadResult, a: str, b: str) -> float | None:
    """Median over rounds of ``a``'s process rate / ``b``'s in the same round."""
    sa, sb = wl.samples.get(a, []), wl.samples.get(b, [])
    ratios = [x.wall_rate / y.wall_rate for x, y in zip(sa, sb, strict=False) if y.wall_rate]
    return statistics.median(ratios) if ratios else None


def _w1x10_section(
    wl: WorkloadResult, w1: WorkloadResult | None, cores: int
) -> tuple[list[str], list[str]]:
    lines = [f"## {wl.title}", "", *[f"- {d}" for d in wl.description], ""]
    lim = machine_limit(w1, cores) if w1 is not None else None
    fast = machine_limit(w1, cores, "ceiling-1t-calls") if w1 is not None else None
    best = hand_best(wl)
    daft = wl.primary("daft")
    refs: list[tuple[str, Callable[[Summary | None], float | None]]] = [
        ("÷ W1's limit", lambda s: None if s is None or lim is None else s.median / lim.rows_per_s),
        ("÷ hand-rolled", lambda s: ratio(s, best[1] if best else None)),
        ("÷ Daft", lambda s: ratio(s, daft)),
    ]
    lines += [*_throughput_table(wl, refs), ""]
    summary = _vs_daft(wl, "cli-4096", lines)
    cli = wl.primary("cli-4096")
    if cli is not None and best is not None:
        text = (
            f"W1X10 CLI vs the best {_label(wl, best[0])}: {cli.median:,.0f} vs "
            f"{best[1].median:,.0f} rows/s process to process = "
            f"**{cli.median / best[1].median:.2f}x**."
        )
        lines += ["", text]
        summary.append(text)
    rate = _window_rate(wl, "cli-4096")
    if rate is not None:
        text = (
            f"W1X10 scoring window (first shard start to last shard end, CLI): {rate:,.0f} rows/s"
            + (
                f" = **{rate / lim.rows_per_s:.2f}x** the machine's limit measured in W1"
                if lim is not None
                else " (W1's limit not measured in this run)"
            )
            + (
                f" ({rate / fast.rows_per_s:.2f}x the stricter limit, the model at its fastest "
                "call size)"
                if fast is not None
                else ""
            )
            + "."
        )
        lines += ["", text]
        summary.append(text)
    lines += ["", *_phases(wl, ["cli-4096"])]
    big, small = wl.wall("cli-4096"), w1.wall("cli-4096") if w1 is not None else None
    rows_big = next(c.rows for c in wl.comparators if c.key == "cli-4096")
    rows_small = next((c.rows for c in w1.comparators if c.key == "cli-4096"), 0) if w1 else 0
    if big is None or small is None or big.median <= small.median:
        lines += ["Marginal rate: not computed (a run of the pair failed or W1 did not run).", ""]
    else:
        marginal = (rows_big - rows_small) / (big.median - small.median)
        fixed = small.median - rows_small / marginal
        text = (
            f"W1 x 10 marginal rate (CLI, process wall): ({rows_big:,} - {rows_small:,}) rows / "
            f"({big.median:.2f} - {small.median:.2f}) s = **{marginal:,.0f} rows/s** in the "
            f"steady state; fixed costs (start-up, planning, finish) about {fixed:.2f} s per run; "
            f"whole process {rows_big / big.median:,.0f} rows/s on the 10x run."
        )
        lines += [text, ""]
        summary.append(text)
    lines += ["### Checks", "", *[f"- {c}" for c in wl.checks], ""]
    return lines, summary


def _w2_section(wl: WorkloadResult, cores: int) -> tuple[list[str], list[str]]:
    lim = machine_limit(wl, cores)
    ceil = wl.primary("ceiling-1t")
    refs: list[tuple[str, Callable[[Summary | None], float | None]]] = [
        (f"÷ model ceiling fp32 ({cores}x1)", lambda s: ratio(s, ceil)),
        ("÷ limit", lambda s: None if s is None or lim is None else s.median / lim.rows_per_s),
    ]
    lines = [f"## {wl.title}", "", *[f"- {d}" for d in wl.description], ""]
    lines += _throughput_table(wl, refs)
    lines.append("")
    summary: list[str] = []
    if lim is not None:
        lines.append(
            f"Limit, as for W1: {cores} / ({lim.s_model * 1e6:.2f} µs model + "
            f"{lim.s_io * 1e6:.3f} µs I/O per row) = {lim.rows_per_s:,.0f} rows/s."
        )
    cli, cli_t = wl.primary("cli-fp32"), wl.timed("cli-fp32")
    if cli is not None and ceil is not None:
        text = (
            f"W2: score-catalog CLI fp32 {cli.median:,.0f} rows/s end to end = "
            f"**{cli.median / ceil.median:.2f}x** the fp32 model ceiling ({ceil.median:,.0f}); "
            f"inside the run (report duration) {_x(ratio(cli_t, ceil))}."
        )
        lines += ["", text]
        summary.append(text)
        rate = _window_rate(wl, "cli-fp32")
        if rate is not None and lim is not None:
            text = (
                f"W2 scoring window (first shard start to last shard end, CLI fp32): "
                f"{rate:,.0f} rows/s = **{rate / ceil.median:.2f}x** the fp32 model ceiling and "
                f"{rate / lim.rows_per_s:.2f}x the limit; the limit itself is "
                f"{lim.rows_per_s / ceil.median:.2f}x the ceiling, since reading and writing "
                "share the cores with the model."
            )
            lines += ["", text]
            summary.append(text)
    pair = wl.meta.get("bf16_pair")
    if pair and any(c.key == pair[1] for c in wl.comparators):
        a, b = wl.primary(pair[0]), wl.primary(pair[1])
        pa_ms, pb_ms = _p50(wl, pair[0]), _p50(wl, pair[1])
        if a is not None and b is not None:
            text = (
                f"W2 `--precision bf16` vs fp32 through the CLI (`{pair[1]}` vs `{pair[0]}`, "
                f"same input): {b.median:,.0f} vs {a.median:,.0f} rows/s = "
                f"**{b.median / a.median:.2f}x** end to end, "
                f"{_x(ratio(wl.timed(pair[1]), wl.timed(pair[0])))} inside the run"
            )
            if pa_ms is not None and pb_ms is not None:
                text += (
                    f"; model call p50 {pb_ms.median:.1f} vs {pa_ms.median:.1f} ms per batch "
                    f"= {pa_ms.median / pb_ms.median:.2f}x the speed"
                )
            text += (
                f". The bf16 autocast ceiling is "
                f"{_x(ratio(wl.primary('ceiling-bf16-1t'), ceil))} the fp32 one."
            )
        else:
            text = "W2 bf16 vs fp32: a run of the pair failed (see Failures)."
        lines += ["", text]
        summary.append(text)
    summary += _vs_daft(wl, "cli-fp32", lines)
    summary += _vs_onnx(wl, "cli-fp32", lines)
    lines += ["", *_phases(wl, ["cli-fp32", "cli-bf16"])]
    for note in wl.notes:
        lines += ["", note]
        summary.append(f"W2: {note}")
    lines += ["", "### Checks", "", *[f"- {c}" for c in wl.checks], ""]
    return lines, summary


def _vmhwm(wl: WorkloadResult, key: str) -> Summary | None:
    """Peak RSS the kernel kept for a single-process comparator (VmHWM, exact)."""
    values = [s.extra.get("vmhwm_bytes") for s in wl.samples.get(key, [])]
    return Summary.of([float(v) for v in values if v])


def _w3_section(wl: WorkloadResult) -> tuple[list[str], list[str]]:
    lines = [f"## {wl.title}", "", *[f"- {d}" for d in wl.description], ""]
    rows = []
    summary = []
    for stem, name in (
        ("cli", "score-catalog CLI"),
        ("pa-prebuffer-true", "pyarrow iter_batches, pre_buffer=True"),
        ("pa-prebuffer-false", "pyarrow iter_batches, pre_buffer=False"),
    ):
        k1, k10 = f"{stem}-1x", f"{stem}-10x"
        measures: list[tuple[str, Summary | None, Summary | None]] = [
            ("tree RSS sum, sampled every 50 ms", wl.rss(k1), wl.rss(k10))
        ]
        if stem != "cli":
            # One short process: the kernel's own high-water mark is exact, where 50 ms
            # sampling can miss the peak of a run that lasts a fraction of a second.
            measures.insert(0, ("VmHWM, exact", _vmhwm(wl, k1), _vmhwm(wl, k10)))
        wa, wb = wl.wall(k1), wl.wall(k10)
        for i, (how, a, b) in enumerate(measures):
            r = ratio(b, a)
            rows.append(
                {
                    "run": name if i == 0 else "″",
                    "how": how,
                    "a": a,
                    "b": b,
                    "n": f"{a.n if a else 0} / {b.n if b else 0}",
                    "ratio": r,
                    "wall": f"{wa.median:.1f} / {wb.median:.1f}" if wa and wb and i == 0 else "",
                }
            )
            if i == 0 and r is not None and a is not None and b is not None:
                summary.append(
                    f"W3 {name}: peak RSS ({how}) {a.median / MIB:,.0f} MiB at 1x, "
                    f"{b.median / MIB:,.0f} MiB at 10x = **{r:.2f}x**."
                )
    lines += markdown_table(
        rows,
        [
            Column("run", "run"),
            Column("peak measured as", "how"),
            Column("1x peak MiB", "a", _mib),
            Column("1x min–max", "a", lambda s: _range(s, MIB)),
            Column("10x peak MiB", "b", _mib),
            Column("10x min–max", "b", lambda s: _range(s, MIB)),
            Column("n", "n"),
            Column("**10x / 1x**", "ratio", _x),
            Column("wall s 1x / 10x", "wall"),
        ],
    )
    lines += [
        "",
        "The pipeline opens shards with `pre_buffer=False` because pyarrow's default keeps "
        "every column chunk it has pre-buffered, so memory grows with the shard: compare the "
        "two pyarrow rows.",
        "",
    ]
    return lines, summary


def _tiny_section(wl: WorkloadResult) -> tuple[list[str], list[str]]:
    lines = [f"## {wl.title}", "", *[f"- {d}" for d in wl.description], ""]
    rows = [
        {
            "command": c.label + (" **FAILED**" if c.key in wl.failures else ""),
            "wall": wl.wall(c.key),
            "inside": summarize_timed(wl, c.key),
            "rss": wl.rss(c.key),
        }
        for c in wl.comparators
    ]
    lines += markdown_table(
        rows,
        [
            Column("command", "command"),
            Column("wall s (median)", "wall", _seconds),
            Column("min–max", "wall", lambda s: _range(s, 1.0, ".2f")),
            Column("n", "wall", lambda s: str(s.n if s else 0)),
            Column("inside run() s", "inside", _seconds),
            Column("peak RSS MiB", "rss", _mib),
        ],
    )
    summary = []
    local, imp = wl.wall("cli-local"), wl.wall("import")
    sync = wl.wall("cli-sync")
    if local is not None and imp is not None:
        text = (
            f"1,000-row job: CLI (local) {local.median:.2f} s, CLI (sync) "
            f"{sync.median if sync else float('nan'):.2f} s, vs a bare "
            f"`import torch, pyarrow, dask.distributed` {imp.median:.2f} s "
            f"(local = {local.median / imp.median:.1f}x the import)."
        )
        lines += ["", text]
        summary.append(text)
    lines += ["", *_phases(wl, ["cli-sync", "cli-sync-cold", "cli-sync-cold-export", "cli-local"])]
    tp, help_ = wl.wall("import-tp"), wl.wall("help")
    cold, export = wl.wall("cli-sync-cold"), wl.wall("cli-sync-cold-export")
    if sync is not None and tp is not None and help_ is not None:
        text = (
            f"Start-up: `score-catalog --help` {help_.median:.2f} s (imports neither torch nor "
            f"Dask); the 1,000-row job in process (sync) {sync.median:.2f} s = "
            f"{sync.median / tp.median:.2f}x a bare `import torch, pyarrow` ({tp.median:.2f} s)"
            + (
                f"; with an empty program cache {cold.median:.2f} s = "
                f"{cold.median / tp.median:.2f}x (the bundle's program file)"
                if cold is not None
                else ""
            )
            + (
                f", {export.median:.2f} s = {export.median / tp.median:.2f}x without it "
                "(torch.export's loader)"
                if export is not None
                else ""
            )
            + "."
        )
        lines += ["", text]
        summary.append(text)
    lines.append("")
    return lines, summary


def _p50(wl: WorkloadResult, key: str) -> Summary | None:
    """Median model-call latency (ms) that score-catalog's own report gives for its batches."""
    return Summary.of(
        [float(v) for s in wl.samples.get(key, []) if (v := s.extra.get("p50_ms")) is not None]
    )


def summarize_timed(wl: WorkloadResult, key: str) -> Summary | None:
    """Seconds of the comparator's timed region (for the CLI: the report's ``duration_s``)."""
    return Summary.of([s.timed_s for s in wl.samples.get(key, []) if s.timed_s is not None])


# ---------------------------------------------------------------------------------------------
# The whole document
# ---------------------------------------------------------------------------------------------


def _profile_section(res: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    from bench.profile_worker import markdown

    lines = ["## Where a worker's time goes", ""]
    if res is None:
        return [*lines, "The profile did not run to the end (see the bench's log).", ""], []
    lines += [*markdown(res), ""]
    st = res["stages_s"]
    pct = {k: st[k] / st["wall"] * 100 for k in ("model", "decode", "write")}
    summary = [
        f"W1 worker, per batch of {res['batch_size']:,}"
        + (
            f" (model calls of {res['call_rows']:,} rows, as a run on this CPU chooses)"
            if res.get("call_rows")
            else " (one model call per batch, as a run on this CPU chooses)"
        )
        + ": the model call is "
        f"{pct['model']:.0f}% of the shard's wall, decode {pct['decode']:.0f}%, write "
        f"{pct['write']:.0f}%, everything else {100 - sum(pct.values()):.0f}% "
        "(`python -m bench.profile_worker`)."
    ]
    calls = res.get("call_us")
    if calls:
        r = calls["score_catalog_bench"] / calls["eager"]
        summary.append(
            f"Batch 1: `score-catalog bench` {calls['score_catalog_bench']:.1f} us per call vs "
            f"the eager module {calls['eager']:.1f} us = **{r:.2f}x** "
            f"({'within' if r <= 1.5 else 'beyond'} the 1.5x target); torch's own "
            f"`ExportedProgram.module()` {calls['exported_module']:.1f} us."
        )
    return lines, summary


def render(
    *,
    facts: dict[str, str],
    sizes: Sizes,
    command: str,
    results: dict[str, WorkloadResult],
    skipped: list[str],
    cores: int,
    total_s: float,
    data_s: float,
    leaks: list[str],
    warnings: list[str],
    precision: bool,
    budget_s: float,
    profile: dict[str, Any] | bool | None = False,
) -> str:
    """The markdown report; ``profile``: bench.profile_worker's result (None: it failed;
    False: not run)."""
    sections: list[str] = []
    summary: list[str] = []
    builders: dict[str, Callable[[WorkloadResult], tuple[list[str], list[str]]]] = {
        "W1": lambda wl: _w1_section(wl, cores),
        "W1X10": lambda wl: _w1x10_section(wl, results.get("W1"), cores),
        "W2": lambda wl: _w2_section(wl, cores),
        "W3": _w3_section,
        "TINY": _tiny_section,
        "DELTA": delta_section,
        "INCREMENTAL": incremental_section,
    }
    for key, build in builders.items():
        if key in results:
            body, summ = build(results[key])
            sections += body
            summary += summ
        else:
            sections += [f"## {key}", "", "Not run in this invocation (`--only`).", ""]
    if profile is not False:
        body, summ = _profile_section(profile if isinstance(profile, dict) else None)
        sections += body
        summary += summ
    head: list[str] = ["# score-catalog benchmarks", ""]
    if sizes.quick:
        head += [
            "> **QUICK RUN — not for reporting.** `--quick`: a tenth of the rows, "
            f"{sizes.repeats} round(s). Run `make bench` on a quiet machine for real figures.",
            "",
        ]
    if skipped:
        head += [f"> **PARTIAL RUN** — not run: {', '.join(skipped)}.", ""]
    if total_s > budget_s:
        head += [
            f"> This run took {total_s / 60:.1f} min, over its {budget_s / 60:g}-minute budget.",
            "",
        ]
    head += [
        f"Generated by `{command}` (`bench/run.py`). Every figure below was measured in this "
        "run and written by the harness. **Figures are medians of alternating runs "
        f"(A B C ... A B C ...) on a shared {cores}-core machine**: trust the ratios more than "
        "the absolute numbers.",
        "",
        f"Rounds per comparator: {sizes.repeats}. Bench wall time: {total_s / 60:.1f} min "
        f"(data generation {data_s:.0f} s; data is cached in `.bench/data` between runs). "
        f"`score-catalog run --precision` available: {'yes' if precision else 'no'}.",
        "",
        "## Summary",
        "",
        *[f"- {s}" for s in summary],
        "",
        "## Machine",
        "",
        *markdown_table(
            [{"fact": k, "value": v} for k, v in facts.items()],
            [Column("", "fact"), Column("", "value")],
        ),
        "",
        "## How it is measured",
        "",
        "- Every comparator runs in a fresh process (its own process tree), one after another, "
        "never two at once. The order alternates across rounds.",
        "- **process wall**: rows / wall time of the whole command, interpreter start-up and "
        "imports included (the CLI: `score-catalog run ... --scheduler local`; the other "
        "end-to-end comparators: `python -m bench.loops ...`).",
        "- **timed region**: inside the process, after imports. Ceilings: the model or I/O loop "
        "only (after warm-up), rate = processes x mean per-process rate with all processes "
        "started together. Hand-rolled and textbook: model load + read + score + write. "
        "Library: the `pipeline.run()` call. CLI: the report's `duration_s`.",
        "- **model ceiling**: the bundle's `torch.export` module on in-memory random tensors, "
        "same batch size, under `inference_mode`.",
        "- **I/O ceiling**: the same reads (id + features, one thread, `pre_buffer=False`), the "
        "float32 feature matrix, and a zstd write of same-typed output columns, with no model.",
        "- **hand-rolled**: `iter_batches` -> numpy -> `torch.from_numpy` -> model -> "
        "`ParquetWriter` (65,536-row row groups, zstd); the multi-process layout forks one "
        "single-threaded process per core over interleaved shards.",
        "- **textbook**: `pandas.read_parquet`, a map-style per-row `Dataset`, "
        "`DataLoader(batch_size=256, shuffle=False)` with the default collate, `to_parquet`.",
        "- score-catalog also writes a `model_version` string column, a manifest and a report; "
        "the other writers write only the id and the model's outputs.",
        "- peak RSS: sum of RSS of the process and all its descendants from /proc every 50 ms.",
        "",
    ]
    tail: list[str] = []
    fails = [(k, c, m) for k, wl in results.items() for c, ms in wl.failures.items() for m in ms]
    if fails or leaks or warnings:
        tail += ["## Failures and leftover processes", ""]
        tail += [f"- {k} `{c}`: {m}" for k, c, m in fails]
        tail += [f"- {x}" for x in leaks]
        tail += [f"- {x}" for x in warnings]
        tail.append("")
    else:
        tail += [
            "## Failures and leftover processes",
            "",
            "None: every run succeeded, and no process outlived its run (the Dask workers were "
            "cleaned up every time).",
            "",
        ]
    timings = [
        f"{k} {wl.seconds:.0f} s (load average {wl.load_before} -> {wl.load_after})"
        for k, wl in results.items()
    ]
    tail += ["## Bench timings", "", "- " + "; ".join(timings), ""]
    return "\n".join(head + sections + tail)


def as_json(results: dict[str, WorkloadResult]) -> dict[str, Any]:
    """Raw samples, for anyone who wants to recompute a figure (written to .bench/)."""
    return {
        k: {c: [s.__dict__ for s in samples] for c, samples in wl.samples.items()}
        for k, wl in results.items()
    }
