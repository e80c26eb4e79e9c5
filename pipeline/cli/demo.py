"""Deterministic demo data and the demo model bundle (``make data`` / ``score-catalog demo``).

The catalog is synthetic: ``item_id``, ``category`` (a string, dictionary-encoded in the files)
and 16 float32 features, with a ``label`` given by a fixed nonlinear rule of the features and
the category, so that the demo model has something real to learn. Same arguments, same bytes.

The demo model (:class:`CatalogRanker`, bundle ``data/models/catalog-ranker``) is a small catalog
model: an embedding of the category beside the 16 numeric features, two inputs declared in its
``model.toml`` (the category through a vocabulary file). :class:`DemoMLP`, a plain 16-256-128-2 MLP
(two ReLU hidden layers, two logits) over the features alone, is the benchmarks' W1 model
(``data/models/catalog-mlp``).
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
# What each category adds to the label rule's score: the category matters, so a model that
# looks it up (through its embedding) beats one that sees the features alone.
CATEGORY_SHIFT = np.array([0.9, -0.7, 0.3, -1.1, 0.6, -0.2, 1.2, -0.9], dtype=np.float32)
#: The demo bundle's vocabulary: id 0 for a category it has not seen.
VOCABULARY = ("<unseen>", *CATEGORIES)


def label_rule(x: np.ndarray, category: np.ndarray) -> np.ndarray:
    """The fixed rule that makes the demo labels (nonlinear, so a linear model is not enough;
    ``category`` holds indices into CATEGORIES)."""
    s = (
        x[:, 0]
        + 0.8 * x[:, 1]
        - 0.6 * x[:, 2] * x[:, 3]
        + 0.5 * np.sin(2.0 * x[:, 4])
        - 0.3 * x[:, 5] ** 2
        + CATEGORY_SHIFT[category]
    )
    labels: np.ndarray = (s > -0.3).astype(np.int64)
    return labels


def make_rows(start: int, n: int, seed: int) -> pa.Table:
    """Rows ``start .. start+n`` of the synthetic catalog (independent of how it is sharded)."""
    rng = np.random.default_rng([seed, start])
    x = rng.standard_normal((n, N_FEATURES), dtype=np.float32)
    cat_idx = rng.integers(0, len(CATEGORIES), n)
    cats = np.asarray(CATEGORIES)[cat_idx]
    cols: dict[str, pa.Array] = {
        "item_id": pa.array(np.arange(start, start + n, dtype=np.int64)),
        "category": pa.array(cats, pa.string()),
    }
    for i, name in enumerate(FEATURES):
        cols[name] = pa.array(x[:, i])
    cols["label"] = pa.array(label_rule(x, cat_idx))
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
    """A plain 16-256-128-2 MLP: two ReLU hidden layers, two logits."""

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


class CatalogRanker(nn.Module):
    """The demo catalog model: forward(features, category), an embedding of the category id
    beside the 16 numeric features, then a small MLP (20-64-32-2)."""

    def __init__(self, n_in: int = N_FEATURES, n_categories: int = len(VOCABULARY), dim: int = 4):
        super().__init__()
        self.category = nn.Embedding(n_categories, dim)
        self.net = nn.Sequential(
            nn.Linear(n_in + dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2)
        )

    def forward(self, features: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(torch.cat([features, self.category(category)], dim=1))
        return out


def ranker_inputs() -> dict[str, dict[str, object]]:
    """The demo bundle's ``[inputs]``: the features, and the category through its vocabulary."""
    return {
        "features": {"columns": list(FEATURES)},
        "category": {"column": "category", "vocabulary": list(VOCABULARY), "oov": 0},
    }


def train_demo_model(
    bundle_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = 400,
    batch: int = 512,
) -> float:
    """Train the demo ranker on rows from the generator, save its bundle (through
    :func:`pipeline.save_bundle`, which checks it loads) and return held-out accuracy."""
    # Here, downward: the model layer is loaded only when the demo trains its model.
    from pipeline.model.export import save_bundle

    torch.manual_seed(seed)
    train = make_rows(10_000_000, steps * batch // 4, seed + 1)
    test = make_rows(20_000_000, 20_000, seed + 2)
    ids = {c: i for i, c in enumerate(VOCABULARY)}

    def xy(t: pa.Table) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = np.column_stack([t.column(c).to_numpy() for c in FEATURES])
        cat = np.array([ids[c] for c in t.column("category").to_pylist()], dtype=np.int64)
        y = np.array(t.column("label").to_numpy())  # writable, for torch
        return torch.from_numpy(x), torch.from_numpy(cat), torch.from_numpy(y)

    xtr, ctr, ytr = xy(train)
    xte, cte, yte = xy(test)
    model = CatalogRanker()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(xtr), (batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(xtr[idx], ctr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    model.eval()
    with torch.inference_mode():
        acc = float((model(xte, cte).argmax(1) == yte).float().mean())
    logger.info(
        "trained demo model in %.1fs: held-out accuracy %.3f", time.perf_counter() - t0, acc
    )
    save_bundle(
        model,
        bundle_dir,
        inputs=ranker_inputs(),
        outputs={"score": "softmax:1", "label": "argmax"},
        example=(xte[:64], cte[:64]),
        name="catalog-ranker",
        version="1",
        description="The demo catalog model: a category embedding beside 16 numeric features "
        "(made by score-catalog demo, pipeline/cli/demo.py).",
        overwrite=True,
    )
    return acc
