"""The benchmark's workloads: sizes, deterministic data under ``.bench/data``, model bundles.

Everything is generated from fixed seeds with the demo's own generator (``pipeline.cli.demo``), so
two runs of the bench score the same bytes. Generated data is cached: a folder is rebuilt only
when the parameters recorded in its ``_bench.json`` differ from what is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

W1_TOML = """\
# score-catalog bench W1: the demo MLP, one output, no pass-through.
name = "bench-w1-mlp"
version = "1"
format = "exported_program"
file = "model.pt2"

[inputs]
columns = [{columns}]

[outputs]
score = "softmax:1"
"""

W2_TOML = """\
# score-catalog bench W2: a seeded, untrained 64-1024-1024-8 MLP over one embedding column.
name = "bench-w2-mlp"
version = "1"
format = "exported_program"
file = "model.pt2"

[inputs]
column = "embedding"
dim = 64

[outputs]
label = "argmax"
logits = "raw"
"""

ROW_GROUP_ROWS = 65_536
W2_DIM = 64
W2_HIDDEN = (1024, 1024)
W2_OUT = 8
SEED = 0


@dataclass(frozen=True)
class Sizes:
    """How big each workload is; ``--quick`` divides rows by 10 and runs each comparator once."""

    quick: bool
    repeats: int
    w1_rows: int
    w1_shards: int
    w1x10_rows: int  # W1 with ten times the rows: fixed costs apart from the steady rate
    w2_rows: int
    w2_shards: int
    w3_rows: int  # the 1x shard; the 10x shard has ten times as many
    w2_part_rows: int  # the bf16-vs-fp32 pair's input when bf16 is emulated (2 shards)
    tiny_rows: int
    # Rows per process for the in-memory model ceilings: enough for a steady rate, small
    # enough that the compute-heavy W2 ceiling does not dominate the run time.
    w1_ceiling_rows: int
    w2_ceiling_rows: int

    @staticmethod
    def make(quick: bool, repeats: int | None) -> Sizes:
        """Full sizes from the brief, or a tenth of the rows for ``--quick``."""
        div = 10 if quick else 1
        return Sizes(
            quick=quick,
            repeats=repeats if repeats is not None else (1 if quick else 3),
            w1_rows=2_000_000 // div,
            w1_shards=16,
            w1x10_rows=20_000_000 // div,
            w2_rows=500_000 // div,
            w2_shards=8,
            w3_rows=500_000 // div,
            w2_part_rows=500_000 // 8 // div,
            tiny_rows=1_000,
            w1_ceiling_rows=500_000 // div,
            w2_ceiling_rows=31_250 // div,
        )


@dataclass(frozen=True)
class FeatureSpec:
    """How a workload's rows become model inputs and outputs (shared with ``bench.loops``)."""

    id_column: str
    columns: tuple[str, ...] | None  # W1: 16 float32 columns stacked
    column: str | None  # W2: one fixed-size list column
    dim: int
    outputs: str  # "score" (softmax:1) or "label_logits" (argmax + raw)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form, to hand to a child process."""
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> FeatureSpec:
        """The inverse of :meth:`to_json`."""
        cols = d.get("columns")
        return FeatureSpec(
            id_column=d["id_column"],
            columns=tuple(cols) if cols is not None else None,
            column=d.get("column"),
            dim=int(d["dim"]),
            outputs=d["outputs"],
        )

    @property
    def read_columns(self) -> list[str]:
        """The columns a scorer must read: the id, then the features."""
        feats = list(self.columns) if self.columns is not None else [self.column or ""]
        return [self.id_column, *feats]


def w1_features() -> FeatureSpec:
    """W1/W3: ``item_id`` + 16 float32 columns, output ``score``."""
    from pipeline.cli.demo import FEATURES

    return FeatureSpec("item_id", tuple(FEATURES), None, len(FEATURES), "score")


def w2_features() -> FeatureSpec:
    """W2: ``item_id`` + a 64-float embedding, outputs ``label`` and ``logits``."""
    return FeatureSpec("item_id", None, "embedding", W2_DIM, "label_logits")


def _fresh(path: Path, params: dict[str, Any]) -> bool:
    """True when ``path`` already holds data made with exactly ``params``."""
    stamp = path / "_bench.json"
    try:
        return json.loads(stamp.read_text()) == params
    except (OSError, ValueError):
        return False


def _stamp(path: Path, params: dict[str, Any]) -> None:
    # Written last: an interrupted generation leaves no stamp and is redone next time.
    (path / "_bench.json").write_text(json.dumps(params, sort_keys=True))


def catalog(path: Path, *, rows: int, shards: int) -> Path:
    """The demo catalog schema (W1, W3, the 1,000-row job), via
    ``pipeline.cli.demo.write_catalog``."""
    from pipeline.cli.demo import write_catalog

    params = {"kind": "catalog", "rows": rows, "shards": shards, "rg": ROW_GROUP_ROWS, "seed": SEED}
    if not _fresh(path, params):
        shutil.rmtree(path, ignore_errors=True)
        write_catalog(path, rows=rows, shards=shards, row_group_rows=ROW_GROUP_ROWS, seed=SEED)
        _stamp(path, params)
    return path


def embeddings(path: Path, *, rows: int, shards: int) -> Path:
    """W2: ``item_id`` + ``embedding`` as ``fixed_size_list<float32>[64]``, written like the demo
    catalog (zstd, no dictionary encoding for floats)."""
    params = {"kind": "embeddings", "rows": rows, "shards": shards, "rg": ROW_GROUP_ROWS}
    params |= {"dim": W2_DIM, "seed": SEED}
    if _fresh(path, params):
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    per = -(-rows // shards)
    for k in range(shards):
        start = k * per
        n = max(0, min(per, rows - start))
        # Seeded by (seed, first row) like make_rows: the bytes do not depend on shard count.
        rng = np.random.default_rng([SEED, start, W2_DIM])
        x = rng.standard_normal((n, W2_DIM), dtype=np.float32)
        emb = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), W2_DIM)
        table = pa.table(
            {"item_id": pa.array(np.arange(start, start + n, dtype=np.int64)), "embedding": emb}
        )
        pq.write_table(
            table,
            path / f"part-{k:05d}.parquet",
            row_group_size=ROW_GROUP_ROWS,
            use_dictionary=False,
            compression="zstd",
        )
    _stamp(path, params)
    return path


def w1_bundle(path: Path, repo: Path) -> Path:
    """The demo 16-256-128-2 MLP with ``score = "softmax:1"`` as its only output.

    The committed bundle's weights are reused when present; otherwise a seeded, untrained
    DemoMLP is exported (throughput does not depend on the weights' values).
    """
    from pipeline.cli.demo import FEATURES

    committed = repo / "data" / "models" / "catalog-mlp" / "model.pt2"
    source = "committed" if committed.exists() else "seeded"
    # The program file is written for one torch version: another one's is rewritten.
    params = {"kind": "w1-bundle", "source": source, "toml": W1_TOML, "torch": _torch_version()}
    if committed.exists():
        params["weights_sha256"] = hashlib.sha256(committed.read_bytes()).hexdigest()
    if _fresh(path, params):
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    columns = ", ".join(f'"{c}"' for c in FEATURES)
    if committed.exists():
        shutil.copyfile(committed, path / "model.pt2")
        (path / "model.toml").write_text(W1_TOML.format(columns=columns))
    else:
        import torch

        from pipeline.cli.demo import DemoMLP, export_bundle

        torch.manual_seed(SEED)
        export_bundle(DemoMLP(), path, W1_TOML.format(columns=columns), n_in=len(FEATURES))
    _write_program_file(path)
    _stamp(path, params)
    return path


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def _write_program_file(path: Path) -> None:
    """The program file ``save_bundle`` writes next to a bundle (pipeline.model.sidecar): what a
    machine with an empty program cache loads instead of calling torch.export's loader. Loaded
    in a child process, so that the bench's own process does not import torch.export."""
    code = (
        "import sys; from pathlib import Path; "
        "from pipeline.model.program import load_model, write_program_file; "
        "p = Path(sys.argv[1]); write_program_file(load_model(str(p)), p)"
    )
    with tempfile.TemporaryDirectory(prefix="bench-program-") as cache:  # not the user's cache
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=env)


def without_program_file(bundle: Path, path: Path) -> Path:
    """A copy of ``bundle`` without its program file: a bundle exported by hand, which a machine
    with an empty program cache loads through torch.export (the bench's ``-cold-export``
    comparators)."""
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(bundle, path, ignore=shutil.ignore_patterns("*.program"))
    return path


def peer_forms(bundle: Path, path: Path) -> Path:
    """The bundle's network in the forms a peer runs best (``bench.daft_runner``): its
    ``Linear`` layers' weights and biases as plain tensors (``layers.pt``, loaded with
    ``weights_only=True`` and rebuilt as ``torch.nn`` layers with ReLU between them: the eager
    module a team that trained the model holds) and that module scripted (``model.ts``,
    TorchScript). Made once per bundle and torch version, in a child process (the bench's own
    process does not import torch.export), and checked against the bundle's program on random
    rows: the bench's MLPs only (a network that is not Linear and ReLU fails the check)."""
    model = bundle / "model.pt2"
    params = {
        "kind": "peer-forms",
        "bundle": hashlib.sha256(model.read_bytes()).hexdigest(),
        "torch": _torch_version(),
    }
    if _fresh(path, params):
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    code = "import sys; from bench.workloads import write_peer_forms as w; w(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(bundle), str(path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],  # where `bench` is importable
    )
    if done.returncode != 0:
        raise RuntimeError(f"peer forms of {bundle}: {done.stderr.strip().splitlines()[-1:]}")
    _stamp(path, params)
    return path


def write_peer_forms(bundle: str, path: str) -> None:
    """The body of :func:`peer_forms` (in its child process)."""
    import warnings

    import torch

    ep = torch.export.load(str(Path(bundle) / "model.pt2"))
    names = [n for n in ep.graph_signature.parameters if n.endswith(".weight")]
    layers = [
        (ep.state_dict[n].detach(), ep.state_dict[n[: -len("weight")] + "bias"].detach())
        for n in names
    ]
    eager = _sequential(layers)
    x = torch.randn(64, layers[0][0].shape[1])
    with torch.inference_mode():
        gap = float((eager(x) - ep.module()(x)).abs().max())
    if gap > 1e-5:
        raise ValueError(f"{bundle}: not a Linear+ReLU MLP (rebuilt differs by {gap:.3g})")
    torch.save(layers, Path(path) / "layers.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated in torch 2.13
        torch.jit.save(torch.jit.script(eager), str(Path(path) / "model.ts"))


def load_peer(form: str, peer: str) -> Any:
    """A model of :func:`peer_forms`'s folder ``peer``: ``eager`` (``layers.pt`` rebuilt as
    ``torch.nn.Linear`` layers with ReLU between them) or ``torchscript`` (``model.ts``)."""
    import torch

    if form == "torchscript":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript is deprecated in torch 2.13
            return torch.jit.load(str(Path(peer) / "model.ts")).eval()
    if form != "eager":
        raise ValueError(f"unknown form {form!r}: eager, torchscript (or the bundle's export)")
    return _sequential(torch.load(str(Path(peer) / "layers.pt"), weights_only=True))


def _sequential(layers: list[tuple[Any, Any]]) -> Any:
    """``Linear`` layers of these (weight, bias) pairs, ReLU between them, in eval mode."""
    import torch

    mods: list[torch.nn.Module] = []
    for w, b in layers:
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        lin.load_state_dict({"weight": w, "bias": b})
        mods += [torch.nn.ReLU(), lin] if mods else [lin]
    return torch.nn.Sequential(*mods).eval()


def w2_bundle(path: Path) -> Path:
    """A seeded 64-1024-1024-8 MLP exported with a dynamic batch dimension."""
    params = {"kind": "w2-bundle", "seed": SEED, "toml": W2_TOML, "shape": [W2_DIM, *W2_HIDDEN]}
    if _fresh(path, params):
        return path
    import torch

    from pipeline.cli.demo import DemoMLP, export_bundle

    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(SEED)
    model = DemoMLP(n_in=W2_DIM, hidden=W2_HIDDEN, n_out=W2_OUT)
    export_bundle(model, path, W2_TOML, n_in=W2_DIM)
    _stamp(path, params)
    return path


@dataclass(frozen=True)
class Data:
    """Paths of everything the suites score."""

    w1: Path
    w1_model: Path  # with its program file, as save_bundle writes it
    w1_model_export: Path  # the same bundle without it: torch.export's loader on a cold machine
    w1_peer: Path  # W1's network as a peer runs it best (peer_forms)
    w2_peer: Path
    w1x10: Path | None  # generated only when the W1X10 suite runs (1.3 GB)
    w2: Path
    w2_model: Path
    w2_part: Path  # an eighth of W2's rows in 2 shards (same generator and seeds)
    w3_1x: Path
    w3_10x: Path
    tiny: Path


def build(root: Path, repo: Path, sizes: Sizes, *, big: bool = True) -> Data:
    """Generate (or reuse) every dataset and bundle under ``root`` (``.bench/``); the 10x W1
    data only when ``big``."""
    d = root / "data"
    m = root / "models"
    w2_model = w2_bundle(m / "w2-mlp")
    return Data(
        w1=catalog(d / "w1", rows=sizes.w1_rows, shards=sizes.w1_shards),
        w1_model=w1_bundle(m / "w1-mlp", repo),
        w1_model_export=without_program_file(m / "w1-mlp", m / "w1-mlp-export"),
        w1_peer=peer_forms(m / "w1-mlp", m / "w1-mlp-peer"),
        w2_peer=peer_forms(w2_model, m / "w2-mlp-peer"),
        w1x10=catalog(d / "w1x10", rows=sizes.w1x10_rows, shards=sizes.w1_shards) if big else None,
        w2=embeddings(d / "w2", rows=sizes.w2_rows, shards=sizes.w2_shards),
        w2_model=w2_model,
        w2_part=embeddings(d / "w2-part", rows=sizes.w2_part_rows, shards=2),
        w3_1x=catalog(d / "w3-1x", rows=sizes.w3_rows, shards=1),
        w3_10x=catalog(d / "w3-10x", rows=10 * sizes.w3_rows, shards=1),
        tiny=catalog(d / "tiny", rows=sizes.tiny_rows, shards=1),
    )


def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and instruction-set flags. psutil has neither, so this is the one
    place that reads /proc/cpuinfo."""
    model, flags = "unknown", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bf16 instructions; without them torch emulates bf16, far slower than
    fp32, which decides how much of W2 the bf16 comparison can afford to score."""
    return bool(cpu_info()[1] & {"avx512_bf16", "amx_bf16"})


def shard_files(path: Path) -> list[Path]:
    """The Parquet shards of a dataset folder, sorted like the pipeline lists them."""
    return sorted(p for p in path.glob("*.parquet") if not p.name.startswith(("_", ".")))
