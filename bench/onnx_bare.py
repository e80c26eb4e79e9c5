"""The bare model under torch and under ONNX Runtime, in memory, alternating: what ``--engine
onnx`` can gain at most on this CPU before any I/O (docs/tuning.md#onnx-runtime-engine).

    python -m bench.onnx_bare [--model w1|w2] [--threads 1] [--batches 1024,4096] [--pairs 5]

Torch runs the bundle as the workers do (``load_model`` + ``forward`` under inference_mode);
ONNX Runtime runs the engine's own export (``pipeline.model.onnxengine``). Each measurement is
one warm-up pair and ``--pairs`` counted pairs, torch then ONNX Runtime, so that a busy spell on
a shared machine lands on both; the ratio is taken pair by pair and its median printed with the
range. Bundles are the bench's own (``.bench/models``, built when missing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rate(fn: Callable[[], object], calls: int, rows: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls * rows / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("w1", "w2"), default="w1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", default="1024,4096")
    p.add_argument("--pairs", type=int, default=5)
    args = p.parse_args()
    # As the CLI sets it before torch is imported (pipeline.core.hugepages).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    import torch

    from bench import workloads
    from pipeline.model.onnxengine import prepare_onnx
    from pipeline.model.program import forward, load_model

    torch.set_num_threads(args.threads)
    models = REPO / ".bench" / "models"
    if args.model == "w1":
        bundle, rows = workloads.w1_bundle(models / "w1-mlp", REPO), 400_000
    else:
        bundle, rows = workloads.w2_bundle(models / "w2-mlp"), 24_000
    model = load_model(str(bundle))
    onnx = prepare_onnx(model)
    print(f"{args.model}: {bundle}, {args.threads} thread(s), torch {torch.__version__}")
    for batch in (int(b) for b in args.batches.split(",")):
        x = model.example(batch, random=True)
        calls = max(2, rows // batch)
        with torch.inference_mode():
            diff = float((forward(model, x) - forward(onnx, x)).abs().max())

            def run_torch(x: tuple[torch.Tensor, ...] = x) -> object:
                return forward(model, x)

            def run_onnx(x: tuple[torch.Tensor, ...] = x) -> object:
                return forward(onnx, x)

            a, b = [], []
            for i in range(args.pairs + 1):
                ra, rb = _rate(run_torch, calls, batch), _rate(run_onnx, calls, batch)
                if i:  # the first pair warms up
                    a.append(ra)
                    b.append(rb)
        ratios = [y / t for t, y in zip(a, b, strict=True)]
        print(
            f"batch {batch:>6,}: torch {statistics.median(a):>10,.0f} rows/s, onnxruntime "
            f"{statistics.median(b):>10,.0f}; onnx/torch pair by pair: median "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); "
            f"max |diff| {diff:.1e}"
        )


if __name__ == "__main__":
    main()
