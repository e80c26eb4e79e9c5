"""Catalog-shaped test models and data: several typed inputs, a string category through a
vocabulary, an int64 id through an embedding, numeric features, and a list-column embedding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

BRANDS = ("<unk>", "acme", "zenith", "orbit", "nova")
SELLERS = 1000
NUMERIC = ("price", "rating", "stock")
EMB_DIM = 8


class Ranker(nn.Module):
    """forward(numeric, brand, seller): embeddings of two ids beside three numeric features."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.brand = nn.Embedding(len(BRANDS), 4)
        self.seller = nn.Embedding(SELLERS, 3)
        self.head = nn.Sequential(nn.Linear(3 + 4 + 3, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(
        self, numeric: torch.Tensor, brand: torch.Tensor, seller: torch.Tensor
    ) -> torch.Tensor:
        x = torch.cat([numeric, self.brand(brand), self.seller(seller)], dim=1)
        out: torch.Tensor = self.head(x)
        return out


class SwappedRanker(Ranker):
    """The same network taking its inputs in another order: bundles declare them by name."""

    def forward(  # type: ignore[override]
        self, seller: torch.Tensor, numeric: torch.Tensor, brand: torch.Tensor
    ) -> torch.Tensor:
        return super().forward(numeric, brand, seller)


class Tower(nn.Module):
    """forward(embedding, numeric): a precomputed (batch, 8) embedding beside numeric features."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(EMB_DIM + 2, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, embedding: torch.Tensor, numeric: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(torch.cat([embedding, numeric], dim=1))
        return out


RANKER_INPUTS = {
    "numeric": {"columns": list(NUMERIC)},
    "brand": {"column": "brand", "dtype": "int64", "vocabulary": list(BRANDS), "oov": 0},
    "seller": {"column": "seller_id", "dtype": "int64", "num_embeddings": SELLERS},
}


def ranker_example(rows: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "numeric": torch.randn(rows, 3, generator=g),
        "brand": torch.randint(0, len(BRANDS), (rows,), generator=g),
        "seller": torch.randint(0, SELLERS, (rows,), generator=g),
    }


def catalog_table(start: int, n: int, seed: int, *, dictionary: bool = False) -> pa.Table:
    """Rows with unseen and null brands, out-of-range and null sellers, a null price, and an
    embedding list column (nulls and wrong lengths included)."""
    rng = np.random.default_rng([seed, start])
    brand = rng.choice(np.array([*BRANDS[1:], "unseen-brand"], dtype=object), n)
    brand[rng.random(n) < 0.02] = None
    seller = rng.integers(0, SELLERS + 10, n).astype(object)  # about 1% out of range
    seller[rng.random(n) < 0.01] = None
    price = rng.random(n).astype(np.float32) * 100
    price_arr = pa.array(price, mask=rng.random(n) < 0.01)
    emb = rng.standard_normal((n, EMB_DIM)).astype(np.float32)
    emb_list = [list(map(float, row)) for row in emb]
    for i in np.flatnonzero(rng.random(n) < 0.01):
        emb_list[i] = None if i % 2 else emb_list[i][:3]
    brand_arr = pa.array(list(brand), pa.string())
    return pa.table(
        {
            "item_id": pa.array(np.arange(start, start + n, dtype=np.int64)),
            "price": price_arr,
            "rating": pa.array(rng.random(n).astype(np.float32) * 5),
            "stock": pa.array(rng.integers(0, 50, n)),
            "brand": brand_arr.dictionary_encode() if dictionary else brand_arr,
            "seller_id": pa.array(list(seller), pa.int64()),
            "embedding": pa.array(emb_list, pa.list_(pa.float32())),
        }
    )


def write_catalog(root: Path, sizes: list[int], *, row_group_rows: int = 700) -> list[Path]:
    """Shards of :func:`catalog_table`; the second one dictionary-encodes ``brand``."""
    root.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for k, n in enumerate(sizes):
        p = root / f"part-{k:05d}.parquet"
        pq.write_table(
            catalog_table(start, n, k, dictionary=k == 1), p, row_group_size=row_group_rows
        )
        paths.append(p)
        start += n
    return paths


def ranker_reference(model: Ranker, table: pa.Table) -> tuple[np.ndarray, dict[int, str]]:
    """The eager module's sigmoid score for each scorable row (by id), and the expected reject
    reason of the others, computed row by row in plain Python: the slow, obvious way."""
    ids = {v: i for i, v in enumerate(BRANDS)}
    rows = table.to_pylist()
    scores, reasons = {}, {}
    for r in rows:
        why = []
        if r["price"] is None:
            why.append("null in price")
        if r["brand"] is None:
            why.append("null in brand")
        if r["seller_id"] is None:
            why.append("null in seller_id")
        elif not 0 <= r["seller_id"] < SELLERS:
            low_high = f"0..{SELLERS - 1} (num_embeddings = {SELLERS})"
            why.append(f"seller_id = {r['seller_id']} is outside {low_high}")
        if why:
            reasons[r["item_id"]] = "; ".join(why)
            continue
        numeric = torch.tensor([[r["price"], r["rating"], float(r["stock"])]], dtype=torch.float32)
        brand = torch.tensor([ids.get(r["brand"], 0)])
        seller = torch.tensor([r["seller_id"]])
        with torch.inference_mode():
            scores[r["item_id"]] = float(torch.sigmoid(model(numeric, brand, seller))[0, 0])
    return scores, reasons  # type: ignore[return-value]


class CountsCalls(nn.Module):
    """Adds 1 to a buffer on every call: a program that mutates the module's own buffer."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        out: torch.Tensor = self.inner(x)
        return out
