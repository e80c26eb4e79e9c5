"""Shared fixtures: small real datasets (several row groups per shard) and real model bundles."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.cli.demo import FEATURES, DemoMLP, export_bundle, make_rows

REPO = Path(__file__).resolve().parents[1]

# Tests must not leak SCORE_CATALOG_* settings from the developer's shell into configs.
for _var in [v for v in os.environ if v.startswith("SCORE_CATALOG_")]:
    del os.environ[_var]

# The caches under XDG_CACHE_HOME (chosen batch sizes, loaded programs: pipeline.model.programcache)
# are the session's own, for the CLI processes the tests start too: what a developer's runs
# left there never changes what a test sees, and the tests leave nothing in their home.
_CACHE_HOME = tempfile.mkdtemp(prefix="score-catalog-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)


def demo_toml(
    columns: tuple[str, ...] = FEATURES,
    *,
    fmt: str = "exported_program",
    file: str = "model.pt2",
    outputs: str = 'score = "softmax:1"\nlabel = "argmax"\n',
    version: str = "1",
) -> str:
    cols = ", ".join(f'"{c}"' for c in columns)
    return (
        f'name = "test-mlp"\nversion = "{version}"\nformat = "{fmt}"\nfile = "{file}"\n'
        f"[inputs]\ncolumns = [{cols}]\n[outputs]\n{outputs}"
    )


def bounded_bundle(path: Path, max_batch: int) -> Path:
    """The demo MLP exported with ``Dim("batch", min=1, max=max_batch)``, as a bundle."""
    import warnings

    path.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation
        ep = torch.export.export(
            make_model().eval(),
            (torch.zeros(2, 16),),
            dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=max_batch)},),
        )
        torch.export.save(ep, path / "model.pt2")
    (path / "model.toml").write_text(demo_toml())
    return path


def make_model(
    seed: int = 0, n_in: int = 16, hidden: tuple[int, int] = (32, 16), n_out: int = 2
) -> DemoMLP:
    torch.manual_seed(seed)
    return DemoMLP(n_in, hidden, n_out).eval()


def demo_bundles(folder: Callable[[str], Path], count: int) -> dict[str, Path]:
    """``count`` bundles of the demo MLP, seeds 0, 1, ..., model versions "1", "2", ... (keyed
    by version), each in ``folder(name)``."""
    out = {}
    for seed in range(count):
        d = folder(f"model{seed + 1}")
        export_bundle(make_model(seed=seed), d, demo_toml(version=str(seed + 1)), n_in=16)
        out[str(seed + 1)] = d
    return out


@pytest.fixture(scope="session")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An exported-program bundle of a small 16-32-16-2 MLP (untrained, seeded)."""
    d = tmp_path_factory.mktemp("bundle")
    export_bundle(make_model(), d, demo_toml(), n_in=16)
    return d


@pytest.fixture(scope="session")
def torchscript_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same network as ``bundle_dir``, as TorchScript."""
    d = tmp_path_factory.mktemp("ts_bundle")
    export_bundle(
        make_model(), d, demo_toml(fmt="torchscript", file="model.ts"), n_in=16, fmt="torchscript"
    )
    return d


def write_shards(
    root: Path, sizes: list[int], *, row_group_rows: int = 1000, seed: int = 0, start: int = 0
) -> list[Path]:
    """Write shards of the demo schema with the given row counts (ids are consecutive)."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, n in enumerate(sizes):
        table = make_rows(start, n, seed)
        start += n
        p = root / f"part-{k:05d}.parquet"
        pq.write_table(table, p, row_group_size=max(1, row_group_rows))
        paths.append(p)
    return paths


@pytest.fixture
def catalog(tmp_path: Path) -> Path:
    """3 shards (2,500 / 1,700 / 3,100 rows) with 1,000-row row groups."""
    root = tmp_path / "catalog"
    write_shards(root, [2500, 1700, 3100], row_group_rows=1000)
    return root


def reference_scores(bundle: Path, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """The model's direct forward on ``table``'s features: (softmax[:,1], argmax)."""
    ep = torch.export.load(str(bundle / "model.pt2")).module()
    cols = [table.column(c).to_numpy().astype(np.float32) for c in FEATURES]
    x = torch.from_numpy(np.column_stack(cols))
    with torch.inference_mode():
        y = ep(x)
    return torch.softmax(y, 1)[:, 1].numpy(), y.argmax(1).numpy()


@pytest.fixture
def read_dataset() -> Callable[[Path], pa.Table]:
    def _read(root: Path) -> pa.Table:
        files = sorted(
            p
            for p in root.rglob("*.parquet")
            if not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)
        )
        return pa.concat_tables([pq.read_table(p) for p in files]) if files else pa.table({})

    return _read
