"""`make gpu-check`: the CUDA path checked against the CPU reference, with throughput and where
the time goes. Run it on a machine with a CUDA device; it refuses to run without one.

1. Scores a demo catalog on the CPU in fp32 (the reference), then on CUDA in fp32 (strict),
   fp32 with TF32, bf16 and fp16, each through ``pipeline.run``; every CUDA output must match
   the reference within that precision's tolerance (max |score diff|, share of labels differing).
2. Times the model alone per batch size and precision (``pipeline.model.tuning.bench_batch_sizes``).
3. Splits one pass over pinned batches into host-to-device copy, compute and device-to-host
   copy with CUDA events.
Prints a Markdown report (paste it into BENCHMARKS.md) and writes it to --out if given.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from bench.mdtable import Column, markdown_table

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "data" / "models" / "catalog-mlp"
MODES = {  # name -> (precision, strict_fp32, tolerance)
    "fp32-strict": ("fp32", True, 1e-5),
    "fp32-tf32": ("fp32", False, 5e-3),
    "bf16": ("bf16", False, 5e-2),
    "fp16": ("fp16", False, 1e-2),
}
BATCHES = (256, 1024, 4096, 16384, 65536)


def _read(out: Path) -> dict[str, np.ndarray]:
    files = sorted(p for p in out.glob("*.parquet"))
    t = [pq.read_table(p) for p in files]
    return {
        "item_id": np.concatenate([x.column("item_id").to_numpy() for x in t]),
        "score": np.concatenate([x.column("score").to_numpy() for x in t]),
        "label": np.concatenate([x.column("label").to_numpy() for x in t]),
    }


def _rows_per_s(v: float) -> str:
    return f"{v:,.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing was run.", file=sys.stderr)
        return 2
    from pipeline import ErrorPolicy, JobConfig, run
    from pipeline.cli.demo import write_catalog
    from pipeline.model.precision import ExecutionOptions, prepare
    from pipeline.model.program import forward, load_model
    from pipeline.model.tuning import bench_batch_sizes

    lines = [
        "## GPU check (`make gpu-check`)",
        "",
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}; "
        f"{args.rows:,} demo rows, demo 16-256-128-2 MLP.",
        "",
    ]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_catalog(root / "cat", rows=args.rows, shards=8, row_group_rows=65_536)

        def job(name: str, device: str, precision: str, strict: bool) -> tuple[float, Path]:
            out = root / name
            cfg = JobConfig(
                input=str(root / "cat"),
                output=str(out),
                model=str(BUNDLE),
                device=device,
                precision=precision,
                strict_fp32=strict,
                batch_size=16_384,
                scheduler="sync",
                parity_tolerance=1.0,
                errors=ErrorPolicy(max_rejected_fraction=0.0),
            )
            rep = run(cfg)
            assert rep.status == "succeeded", rep.data["errors"]
            return rep["rows_per_s"], out

        cpu_rate, cpu_out = job("cpu", "cpu", "fp32", True)
        ref = _read(cpu_out)
        parity = [
            {"run": "cpu fp32", "rate": f"{cpu_rate:,.0f}", "diff": "-", "mism": "-", "tol": "-"}
            | {"ok": "reference"}
        ]
        for name, (precision, strict, tol) in MODES.items():
            rate, out = job(name, "cuda", precision, strict)
            got = _read(out)
            same_ids = np.array_equal(got["item_id"], ref["item_id"])
            diff = float(np.abs(got["score"] - ref["score"]).max())
            mism = float((got["label"] != ref["label"]).mean())
            good = same_ids and diff <= tol and mism <= tol
            ok &= good
            parity.append(
                {"run": f"cuda {name}", "rate": f"{rate:,.0f}", "diff": f"{diff:.2e}"}
                | {"mism": f"{mism:.2e}", "tol": f"{tol:g}", "ok": "yes" if good else "NO"}
            )
        lines += markdown_table(
            parity,
            [
                Column("run", "run"),
                Column("rows/s (end to end)", "rate", right=True),
                Column("max abs score diff vs CPU", "diff", right=True),
                Column("labels differing", "mism", right=True),
                Column("tolerance", "tol", right=True),
                Column("ok", "ok"),
            ],
        )

    model = load_model(str(BUNDLE), "cuda")
    x = torch.randn(262_144, model.width)
    lines += [
        "",
        "Model alone (best of 3, after warm-up, synchronized):",
        "",
    ]
    speeds = []
    for name, (precision, strict, _) in MODES.items():
        prepared, _ = prepare(model, ExecutionOptions(precision, False, strict))
        rows = bench_batch_sizes(lambda t, m=prepared: forward(m, t), x, model.device, BATCHES)
        speeds.append({"mode": name} | {f"b{r.batch}": r.samples_per_s for r in rows})
    lines += markdown_table(
        speeds,
        [
            Column("mode", "mode"),
            *[Column(f"batch {b:,}", f"b{b}", _rows_per_s, right=True) for b in BATCHES],
        ],
    )

    lines += ["", "Where one pass over pinned 16,384-row batches spends its time (fp32-tf32):", ""]
    prepared, _ = prepare(model, ExecutionOptions("fp32", False, False))
    batches = [b.pin_memory() for b in x.split(16_384)]
    h2d = comp = d2h = 0.0
    with torch.inference_mode():
        for b in batches:
            e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            e[0].record()
            xd = b.to("cuda", non_blocking=True)
            e[1].record()
            y = forward(prepared, xd)
            e[2].record()
            y.float().cpu()
            e[3].record()
            torch.cuda.synchronize()
            h2d += e[0].elapsed_time(e[1])
            comp += e[1].elapsed_time(e[2])
            d2h += e[2].elapsed_time(e[3])
    total = h2d + comp + d2h
    share = {
        k: f"{v / total:.0%} ({v:.1f} ms)"
        for k, v in (("H2D", h2d), ("compute", comp), ("D2H", d2h))
    }
    lines += markdown_table([share], [Column(k, k, right=True) for k in share])
    lines += [
        "",
        f"All CUDA results within tolerance of the CPU reference: {'yes' if ok else 'NO'}.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
