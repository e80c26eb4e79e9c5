"""Model bundles: ``model.toml`` plus one weights file, loaded without unpickling arbitrary objects.

A bundle declares its input spec (numeric columns stacked in order, or one fixed-size list
column) and its outputs (output column name -> how it is derived from the model's output row).
Loading checks the bundle with a 1-row and a 2-row dry run before any data is scored.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import sys
import threading
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from pipeline import storage
from pipeline.errors import ConfigError, ModelError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

logger = logging.getLogger(__name__)

FORMATS = ("exported_program", "torchscript")
_TRANSFORM_RE = re.compile(r"^(softmax|sigmoid):(\d+)$|^(sigmoid|argmax|raw)$")
_BUNDLE_KEYS = {"name", "version", "format", "file", "inputs", "outputs", "description"}
EXPORT_HINT = (
    "export it with a dynamic batch dimension: "
    "ep = torch.export.export(model.eval(), (torch.zeros(2, N),), "
    "dynamic_shapes=({0: torch.export.Dim('batch', min=1)},)); torch.export.save(ep, 'model.pt2'); "
    'then set format = "exported_program" and file = "model.pt2" in model.toml'
)


@dataclass(frozen=True)
class OutputSpec:
    """One output column: its name and the transform of the model's output row."""

    name: str
    transform: str  # softmax, sigmoid, argmax or raw
    index: int | None = None

    def describe(self) -> str:
        return self.transform if self.index is None else f"{self.transform}:{self.index}"

    def arrow_type(self, width: int) -> pa.DataType:
        if self.transform == "argmax":
            return pa.int64()
        if self.transform == "raw" and width > 1:
            return pa.list_(pa.float32(), width)
        return pa.float32()


@dataclass(frozen=True)
class BundleSpec:
    """What ``model.toml`` declares."""

    uri: str
    name: str
    version: str
    format: str
    file: str
    columns: tuple[str, ...] | None
    column: str | None
    dim: int | None
    outputs: tuple[OutputSpec, ...]

    @property
    def input_columns(self) -> tuple[str, ...]:
        """Columns the model reads, in order."""
        return self.columns if self.columns is not None else (self.column or "",)

    def describe_inputs(self) -> str:
        if self.columns is not None:
            return f"inputs.columns = {list(self.columns)}"
        return f"inputs.column = {self.column!r}" + (f" (dim {self.dim})" if self.dim else "")


def parse_bundle_toml(raw: bytes, uri: str) -> BundleSpec:
    """Validate ``model.toml``; every problem is reported at once."""
    where = f"{uri}/model.toml"
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"model bundle {where} is not valid TOML: {e}") from e
    p = _header_problems(doc)
    columns, column, dim = _parse_inputs(doc.get("inputs"), p)
    outputs = _parse_outputs(doc.get("outputs"), p)
    if p:
        raise ModelError(f"model bundle {where} is invalid:\n" + "\n".join(f"  - {x}" for x in p))
    return BundleSpec(
        uri=uri,
        name=doc["name"],
        version=doc["version"],
        format=doc["format"],
        file=doc["file"],
        columns=columns,
        column=column,
        dim=dim,
        outputs=tuple(outputs),
    )


def _header_problems(doc: Mapping[str, Any]) -> list[str]:
    """Problems with the bundle's top-level keys (name, version, format, file)."""
    p = [
        f"unknown key {key!r}; known keys: {', '.join(sorted(_BUNDLE_KEYS))}"
        for key in sorted(set(doc) - _BUNDLE_KEYS)
    ]
    for key in ("name", "version", "format", "file"):
        if not isinstance(doc.get(key), str) or not doc.get(key):
            p.append(f"{key} must be a non-empty string")
    f = doc.get("file")
    if isinstance(f, str) and (f.startswith("/") or ".." in f.split("/") or "://" in f):
        p.append(f"file = {f!r} must be a file name inside the bundle directory")
    fmt = doc.get("format")
    if fmt in ("pickle", "state_dict", "torch_save"):
        p.append(
            f"format = {fmt!r} is refused: pickles can run arbitrary code on load; {EXPORT_HINT}"
        )
    elif isinstance(fmt, str) and fmt not in FORMATS:
        p.append(f"format = {fmt!r} is not one of {', '.join(FORMATS)}")
    return p


def _parse_inputs(
    inputs: Any, p: list[str]
) -> tuple[tuple[str, ...] | None, str | None, int | None]:
    """``[inputs]``: (columns, column, dim); problems are appended to ``p``."""
    if not isinstance(inputs, Mapping):
        p.append('[inputs] table is required (columns = [...] or column = "...")')
        return None, None, None
    for key in sorted(set(inputs) - {"columns", "column", "dim"}):
        p.append(f"unknown key inputs.{key}; known: columns, column, dim")
    if ("columns" in inputs) == ("column" in inputs):
        p.append('[inputs] needs exactly one of columns = [...] or column = "..."')
        return None, None, None
    if "columns" in inputs:
        cols = inputs["columns"]
        if not (isinstance(cols, list) and cols and all(isinstance(c, str) for c in cols)):
            p.append("inputs.columns must be a non-empty list of column names")
        elif len(set(cols)) != len(cols):
            p.append("inputs.columns names a column twice")
        else:
            return tuple(cols), None, None
        return None, None, None
    column = None
    if not isinstance(inputs["column"], str) or not inputs["column"]:
        p.append("inputs.column must be a column name")
    else:
        column = inputs["column"]
    dim = None
    if "dim" in inputs:
        dim_ok = isinstance(inputs["dim"], int) and not isinstance(inputs["dim"], bool)
        if not dim_ok or inputs["dim"] < 1:
            p.append("inputs.dim must be an integer >= 1")
        else:
            dim = inputs["dim"]
    return None, column, dim


def _parse_outputs(raw: Any, p: list[str]) -> list[OutputSpec]:
    """``[outputs]`` in declaration order; problems are appended to ``p``."""
    if not isinstance(raw, Mapping) or not raw:
        p.append('[outputs] table is required, e.g. score = "softmax:1"')
        return []
    outputs: list[OutputSpec] = []
    for name, how in raw.items():
        m = _TRANSFORM_RE.match(how) if isinstance(how, str) else None
        if m is None:
            p.append(
                f"outputs.{name} = {how!r} is not one of softmax:K, sigmoid, sigmoid:K, argmax, raw"
            )
        elif m.group(1):
            outputs.append(OutputSpec(name, m.group(1), int(m.group(2))))
        else:
            outputs.append(OutputSpec(name, m.group(3)))
    return outputs


@dataclass
class LoadedModel:
    """A bundle loaded on a device, checked by its dry runs."""

    spec: BundleSpec
    sha256: str
    module: Any
    device: torch.device
    width: int  # features per row
    out_width: int  # values per output row


def resolve_device(requested: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; an unavailable device is a clear error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(requested)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {requested!r} is not available on this machine "
                "(torch.cuda.is_available() is False); use --device cpu or --device auto"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {requested!r} does not exist: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def read_bundle(
    uri: str, options: Mapping[str, Any] | None = None
) -> tuple[BundleSpec, bytes, str]:
    """Read ``model.toml`` and the weights; returns (spec, weights bytes, SHA-256).

    The SHA-256 is taken over the bytes of ``model.toml`` followed by the weights file's bytes.
    """
    root = storage.locate(uri, options)
    toml_loc = root.child("model.toml")
    try:
        raw = storage.read_bytes(toml_loc)
    except (FileNotFoundError, NotADirectoryError) as e:
        if isinstance(e, NotADirectoryError) or storage.is_file(root):
            raise _file_not_bundle(uri, options) from None
        raise ModelError(
            f"model bundle {uri} has no model.toml (a bundle is a directory holding model.toml "
            "and one weights file)"
        ) from None
    spec = parse_bundle_toml(raw, uri)
    w_loc = root.child(spec.file)
    try:
        weights = storage.read_bytes(w_loc)
    except FileNotFoundError:
        raise ModelError(f"model bundle {uri}: weights file {spec.file!r} does not exist") from None
    sha = hashlib.sha256(raw + weights).hexdigest()
    return spec, weights, sha


def _file_not_bundle(uri: str, options: Mapping[str, Any] | None) -> ConfigError:
    """``--model`` names a file (the weights, model.toml) where the bundle folder is expected."""
    parent = uri.rstrip("/").rpartition("/")[0]
    hint = "give the folder holding model.toml and the weights file"
    if parent and storage.exists(storage.locate(parent, options).child("model.toml")):
        hint = f"give its folder, the bundle: --model {parent}"
    return ConfigError(f"model = {uri!r} is a file, not a model bundle folder; {hint}")


def _looks_like_pickle(weights: bytes) -> bool:
    try:
        with zipfile.ZipFile(io.BytesIO(weights)) as z:
            names = z.namelist()
    except zipfile.BadZipFile:
        # Legacy (pre-1.6) torch.save files are bare pickles: protocol 2+ starts with 0x80.
        return weights[:1] == b"\x80"
    has_pickle = any(n.endswith("/data.pkl") for n in names)
    is_script = any("/code/" in n for n in names)
    is_export = any(n.endswith(".json") and "models/" in n for n in names)
    return has_pickle and not is_script and not is_export


def _deserialize(spec: BundleSpec, weights: bytes, device: torch.device) -> Any:
    where = f"model bundle {spec.uri} ({spec.file}, format {spec.format})"
    if _looks_like_pickle(weights):
        raise ModelError(
            f"{where}: the weights file is a pickled object (torch.save of a module or "
            "state_dict), which is refused because unpickling can run arbitrary code; "
            + EXPORT_HINT
        )
    try:
        if spec.format == "exported_program":
            ep = torch.export.load(io.BytesIO(weights))
            module = ep.module()
        else:
            # Deprecated in torch 2.13 but still the only safe loader for older models; say so
            # once in the log rather than as a warning that -W error would turn into a failure.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(  # type: ignore[no-untyped-call]
                    io.BytesIO(weights), map_location="cpu"
                )
            logger.warning(
                "model bundle %s is TorchScript, which torch deprecates; re-export it with "
                "torch.export when you can",
                spec.uri,
            )
    except Exception as e:
        raise ModelError(f"{where}: cannot load the weights file: {e}") from e
    try:
        module = module.to(device)
    except Exception as e:  # exported modules may refuse .to() on older torch
        raise ModelError(f"{where}: cannot move the model to {device}: {e}") from e
    if hasattr(module, "eval") and spec.format != "exported_program":
        module.eval()
    return module


def _forward(module: Any, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, expected one tensor")
    if out.dim() == 1:
        out = out.unsqueeze(1)
    return out


def forward(model: LoadedModel, x: torch.Tensor) -> torch.Tensor:
    """The model's output for a (batch, width) float32 tensor, as (batch, out_width)."""
    return _forward(model.module, x)


def _dry_run(spec: BundleSpec, module: Any, width: int, device: torch.device) -> int:
    where = f"model bundle {spec.uri} ({spec.describe_inputs()})"
    outs: list[torch.Tensor] = []
    for rows in (1, 2):
        x = torch.zeros(rows, width, dtype=torch.float32, device=device)
        try:
            with torch.inference_mode():
                y = _forward(module, x)
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            if rows == 2 and outs:
                raise ModelError(
                    f"{where}: the model accepts 1 row but not 2 ({text}); its batch dimension "
                    f"is static. Re-{EXPORT_HINT}"
                ) from e
            raise ModelError(
                f"{where}: the model rejected a ({rows}, {width}) float32 input built from the "
                f"declared inputs: {text}. Check that the bundle's inputs match what the model "
                "was exported with."
            ) from e
        if y.shape[0] != rows:
            raise ModelError(
                f"{where}: a {rows}-row input gave an output of shape {tuple(y.shape)}; the "
                f"first dimension must be the batch. Re-{EXPORT_HINT}"
            )
        outs.append(y)
    out_width = int(outs[0].shape[1])
    for o in spec.outputs:
        if o.transform == "softmax" and (out_width < 2 or (o.index or 0) >= out_width):
            raise ModelError(
                f"model bundle {spec.uri}: outputs.{o.name} = {o.describe()!r} needs at least "
                f"{max(2, (o.index or 0) + 1)} values per output row, but the model gives "
                f"{out_width}"
            )
        if o.transform == "sigmoid" and (
            (o.index is None and out_width != 1) or (o.index or 0) >= out_width
        ):
            raise ModelError(
                f"model bundle {spec.uri}: outputs.{o.name} = {o.describe()!r} does not fit a "
                f"model with {out_width} values per output row (use sigmoid:K to pick one)"
            )
        if o.transform == "argmax" and out_width < 2:
            raise ModelError(
                f"model bundle {spec.uri}: outputs.{o.name} = 'argmax' needs at least 2 values "
                f"per output row, but the model gives {out_width}"
            )
    return out_width


_CACHE: dict[tuple[str, str, str, int], LoadedModel] = {}
_CACHE_LOCK = threading.Lock()


def load_model(
    uri: str,
    device: str | torch.device = "cpu",
    *,
    width: int | None = None,
    options: Mapping[str, Any] | None = None,
    expected_sha256: str | None = None,
) -> LoadedModel:
    """Load and dry-run a bundle, once per process for each (bundle, device, content).

    ``width`` is needed only for a ``column`` input without ``dim`` (it comes from the data).
    ``expected_sha256`` makes a worker refuse a bundle that changed after the run started.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if expected_sha256 is not None and width is not None:
        # A worker asking for the bundle the run planned with: reuse it without reading and
        # hashing the weights again for every shard.
        with _CACHE_LOCK:
            hit = _CACHE.get((uri, str(dev), expected_sha256, width))
        if hit is not None:
            return hit
    spec, weights, sha = read_bundle(uri, options)
    if expected_sha256 is not None and sha != expected_sha256:
        raise ModelError(
            f"model bundle {uri} changed while the run was going on (SHA-256 {sha[:12]} instead "
            f"of {expected_sha256[:12]}); rerun the job"
        )
    if spec.columns is not None:
        w = len(spec.columns)
    elif spec.dim is not None:
        w = spec.dim
    elif width is not None:
        w = width
    else:
        raise ModelError(
            f"model bundle {uri}: inputs.column needs inputs.dim, or data to take it from"
        )
    if width is not None and width != w:
        raise ModelError(
            f"model bundle {uri}: {spec.describe_inputs()} declares {w} features per row "
            f"but the data has {width}"
        )
    key = (uri, str(dev), sha, w)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            return cached
        module = _deserialize(spec, weights, dev)
        out_width = _dry_run(spec, module, w, dev)
        loaded = LoadedModel(spec, sha, module, dev, w, out_width)
        _CACHE[key] = loaded
        logger.info("loaded model %s v%s (%s) on %s", spec.name, spec.version, sha[:12], dev)
        return loaded
