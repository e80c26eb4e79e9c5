"""Deterministic demo data and the demo model bundle (``make data`` / ``score-catalog demo``).

The catalog is synthetic: ``item_id``, ``category`` and 16 float32 features, with a ``label``
given by a fixed nonlinear rule of the features, so that the demo MLP (16-256-128-2, ReLU) has
something real to learn. Same arguments, same bytes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

logger = logging.getLogger(__name__)

N_FEATURES = 16
FEATURES = tuple(f"f{i}" for i in range(N_FEATURES))
CATEGORIES = ("books", "garden", "kitchen", "toys", "sports", "music", "tools", "beauty")

BUNDLE_TOML = """\
# The demo bundle: made by `score-catalog demo` (pipeline/demo.py), deterministic.
name = "catalog-mlp"
version = "1"
format = "exported_program"
file = "model.pt2"

[inputs]
columns = [{columns}]

[outputs]
score = "softmax:1"
label = "argmax"
"""


def label_rule(x: np.ndarray) -> np.ndarray:
    """The fixed rule that makes the demo labels (nonlinear, so a linear model is not enough)."""
    s = (
        x[:, 0]
        + 0.8 * x[:, 1]
        - 0.6 * x[:, 2] * x[:, 3]
        + 0.5 * np.sin(2.0 * x[:, 4])
        - 0.3 * x[:, 5] ** 2
    )
    labels: np.ndarray = (s > -0.3).astype(np.int64)
    return labels


def make_rows(start: int, n: int, seed: int) -> pa.Table:
    """Rows ``start .. start+n`` of the synthetic catalog (independent of how it is sharded)."""
    rng = np.random.default_rng([seed, start])
    x = rng.standard_normal((n, N_FEATURES), dtype=np.float32)
    cats = np.asarray(CATEGORIES)[rng.integers(0, len(CATEGORIES), n)]
    cols: dict[str, pa.Array] = {
        "item_id": pa.array(np.arange(start, start + n, dtype=np.int64)),
        "category": pa.array(cats, pa.string()),
    }
    for i, name in enumerate(FEATURES):
        cols[name] = pa.array(x[:, i])
    cols["label"] = pa.array(label_rule(x))
    return pa.table(cols)


def write_catalog(
    out_dir: str | Path,
    *,
    rows: int = 200_000,
    shards: int = 8,
    row_group_rows: int = 8_192,
    seed: int = 0,
) -> list[Path]:
    """Write ``rows`` rows as ``shards`` Parquet files of several row groups each."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    per = -(-rows // shards)
    for k in range(shards):
        start = k * per
        n = max(0, min(per, rows - start))
        table = make_rows(start, n, seed)
        path = out / f"part-{k:05d}.parquet"
        # Dictionary encoding bloats float features (191 MB vs 128 MB raw): keep it for strings.
        pq.write_table(
            table,
            path,
            row_group_size=row_group_rows,
            use_dictionary=["category"],
            compression="zstd",
        )
        paths.append(path)
    return paths


class DemoMLP(nn.Module):
    """The textbook's 16-256-128-2 MLP."""

    def __init__(
        self, n_in: int = N_FEATURES, hidden: tuple[int, int] = (256, 128), n_out: int = 2
    ):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_in, hidden[0]),
            nn.ReLU(),
            nn.Linear(hidden[0], hidden[1]),
            nn.ReLU(),
            nn.Linear(hidden[1], n_out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def export_bundle(
    model: nn.Module,
    bundle_dir: str | Path,
    toml_text: str,
    *,
    n_in: int,
    fmt: str = "exported_program",
) -> Path:
    """Export ``model`` with a dynamic batch dimension and write the bundle."""
    out = Path(bundle_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    example = (torch.zeros(2, n_in),)
    if fmt == "exported_program":
        ep = torch.export.export(
            model, example, dynamic_shapes=({0: torch.export.Dim("batch", min=1)},)
        )
        torch.export.save(ep, out / "model.pt2")
    else:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript is deprecated in torch 2.13
            torch.jit.save(torch.jit.script(model), out / "model.ts")
    (out / "model.toml").write_text(toml_text)
    return out


def train_demo_model(
    bundle_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = 400,
    batch: int = 512,
) -> float:
    """Train the demo MLP on rows from the generator, export it, and return held-out accuracy."""
    torch.manual_seed(seed)
    train = make_rows(10_000_000, steps * batch // 4, seed + 1)
    test = make_rows(20_000_000, 20_000, seed + 2)

    def xy(t: pa.Table) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.column_stack([t.column(c).to_numpy() for c in FEATURES])
        return torch.from_numpy(x), torch.from_numpy(t.column("label").to_numpy())

    xtr, ytr = xy(train)
    xte, yte = xy(test)
    model = DemoMLP()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(xtr), (batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    model.eval()
    with torch.inference_mode():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    logger.info(
        "trained demo model in %.1fs: held-out accuracy %.3f", time.perf_counter() - t0, acc
    )
    columns = ", ".join(f'"{c}"' for c in FEATURES)
    export_bundle(model, bundle_dir, BUNDLE_TOML.format(columns=columns), n_in=N_FEATURES)
    return acc
