"""Model bundles: ``model.toml`` plus one weights file, loaded without unpickling arbitrary objects.

A bundle declares its inputs (:mod:`pipeline.model.inputs`: one tensor built from numeric columns or
a list column, or several named, typed tensors, with vocabularies for string columns) and its
outputs (output column name -> how it is derived from the model's output row). Loading checks
the declared inputs against the program's own signature where it has one (an exported program
records each input's dtype and shape) and runs the model on 1 and 2 rows before any data is
scored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from pipeline.core.errors import ConfigError, ModelError
from pipeline.io import listing, storage
from pipeline.model.inputs import InputSpec, parse_inputs, parse_vocabulary

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


#: A model's inputs for a batch: one tensor per declared input, in declared order.
Inputs = tuple[torch.Tensor, ...]


def as_inputs(xs: Inputs | torch.Tensor) -> Inputs:
    """``xs`` as a tuple: a single-input model's tensor may be given alone."""
    return (xs,) if isinstance(xs, torch.Tensor) else tuple(xs)


def rows_of(xs: Inputs) -> int:
    """The number of rows in a batch of inputs."""
    return int(xs[0].shape[0]) if xs else 0


@dataclass(frozen=True)
class BundleSpec:
    """What ``model.toml`` declares."""

    uri: str
    name: str
    version: str
    format: str
    file: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]

    @property
    def input_columns(self) -> tuple[str, ...]:
        """Columns the model reads, in order, each once."""
        return tuple(dict.fromkeys(c for i in self.inputs for c in i.source_columns))

    @property
    def single(self) -> InputSpec | None:
        """The one input of a single-input bundle (None with several)."""
        return self.inputs[0] if len(self.inputs) == 1 else None

    # The single input's source, for code that handles one float32 tensor (benchmarks).
    @property
    def columns(self) -> tuple[str, ...] | None:
        return self.single.columns if self.single is not None else None

    @property
    def column(self) -> str | None:
        return self.single.column if self.single is not None else None

    @property
    def dim(self) -> int | None:
        return self.single.dim if self.single is not None else None

    def describe_inputs(self) -> str:
        return "; ".join(i.describe() for i in self.inputs)


def parse_bundle_toml(raw: bytes, uri: str) -> BundleSpec:
    """Validate ``model.toml``; every problem is reported at once."""
    where = f"{uri}/model.toml"
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"model bundle {where} is not valid TOML: {e}") from e
    p = _header_problems(doc)
    inputs = parse_inputs(doc.get("inputs"), p)
    outputs = _parse_outputs(doc.get("outputs"), p)
    if p:
        raise ModelError(f"model bundle {where} is invalid:\n" + "\n".join(f"  - {x}" for x in p))
    return BundleSpec(
        uri=uri,
        name=doc["name"],
        version=doc["version"],
        format=doc["format"],
        file=doc["file"],
        inputs=inputs,
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
        if not storage.exists(root):
            # A typo in the path, not a folder that lacks its model.toml: say which.
            raise ModelError(
                f"model bundle {uri} does not exist{listing.missing_hint(root)} (a bundle is a "
                "directory holding model.toml and one weights file)"
            ) from None
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
    spec, vocab_bytes = _with_vocabularies(spec, root)
    sha = hashlib.sha256(raw + weights + vocab_bytes).hexdigest()
    return spec, weights, sha


def _with_vocabularies(spec: BundleSpec, root: storage.Location) -> tuple[BundleSpec, bytes]:
    """``spec`` with each vocabulary file's values read in, and those files' bytes (in input
    order) for the bundle's SHA-256: a changed vocabulary is a changed model."""
    if not any(i.vocabulary for i in spec.inputs):
        return spec, b""
    inputs, raw, problems = [], b"", []
    for inp in spec.inputs:
        if inp.vocabulary is None:
            inputs.append(inp)
            continue
        where = f"model bundle {spec.uri}: vocabulary {inp.vocabulary} of input {inp.name!r}"
        try:
            data = storage.read_bytes(root.child(inp.vocabulary))
        except FileNotFoundError:
            problems.append(f"{where} does not exist")
            continue
        values, bad = parse_vocabulary(data, inp, where)
        problems += bad
        raw += data
        inputs.append(dataclasses.replace(inp, vocab=values))
    if problems:
        raise ModelError("\n".join(problems))
    return dataclasses.replace(spec, inputs=tuple(inputs)), raw


def _file_not_bundle(uri: str, options: Mapping[str, Any] | None) -> ConfigError:
    """``--model`` names a file (the weights, model.toml) where the bundle folder is expected."""
    parent = uri.rstrip("/").rpartition("/")[0]
    hint = "give the folder holding model.toml and the weights file"
    if parent and storage.exists(storage.locate(parent, options).child("model.toml")):
        hint = f"give its folder, the bundle: --model {parent}"
    return ConfigError(f"model = {uri!r} is a file, not a model bundle folder; {hint}")
