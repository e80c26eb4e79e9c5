"""A bundle's program file: the program cache's entry, written next to the bundle, that a fresh
machine finds and uses.

The program cache (:mod:`pipeline.model.programcache`) lives under ``$XDG_CACHE_HOME``: a fresh
container each night starts with it empty, and every run then loads the bundle through
``torch.export.load`` (which imports ``torch._dynamo`` and the export serializer: W1 measured
7.21 s a run cold against 4.98 s warm on a 2-core AMD EPYC). :func:`pipeline.save_bundle`
therefore also writes ``<weights file>.torch<version>.program`` into the bundle, and a load
that misses the local cache reads it from wherever the bundle is (a folder, object storage).

It is not a pickle: nothing in it can run code. It is one JSON header (the program's graph as a
list of aten operations, each looked up by name in ``torch.ops.aten`` and its keyword names
checked against the operation's schema; what the run reads from the program besides its graph;
where each tensor lies) and the raw bytes of the weights and of a probe call's inputs and
outputs. It is checked as the cache's entries are: written for this bundle's SHA-256 and this
torch version, every weight matching its SHA-256, the probe reproduced bit for bit. Anything
else is ignored with a warning (never deleted: it is part of the user's bundle) and the bundle
loaded the slow way. A bundle's SHA-256 does not cover this file; it is a faster way to load the
same program, and a file that fails any check is never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import re
import struct
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pipeline.io import storage
from pipeline.model import programcache
from pipeline.model.bundle import BundleSpec

logger = logging.getLogger(__name__)

MAGIC = b"score-catalog program\n"
FORMAT = 1
_ALIGN = 64  # each tensor's bytes start at a multiple of this (a dtype view needs alignment)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PART = re.compile(r"(?:[A-Za-z][A-Za-z0-9_]*|[0-9]+)\Z")  # one part of a weight's dotted name
# Python functions an exported graph may call besides aten operations (on sizes, or picking one
# output of an operation that returns several): builtins, looked up here by name, never imported.
_PYTHON_OPS = {
    "getitem": operator.getitem,
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
}
_KINDS: dict[str, type] = {
    "dtype": torch.dtype,
    "layout": torch.layout,
    "memory_format": torch.memory_format,
}


class Unsupported(ValueError):
    """A graph this format does not describe (the bundle then has no program file)."""


def file_name(spec: BundleSpec) -> str:
    """The program file's name in the bundle: ``<weights file>.torch<version>.program``."""
    version = "".join(c if c.isalnum() or c in ".-" else "_" for c in torch.__version__)
    return f"{spec.file}.torch{version}.program"


# --------------------------------------------------------------------------------------------
# Writing


def encode(
    sha256: str,
    call: programcache.GraphCall,
    facts: programcache.ProgramFacts,
    probe: tuple[torch.Tensor, ...],
    weights_sha256: str | None = None,
) -> bytes:
    """The program file's bytes for ``call`` (raises :class:`Unsupported` for a graph it cannot
    describe: a submodule, a Python function outside :data:`_PYTHON_OPS`, an odd constant)."""
    for target in call.targets:
        _check_target(target)
    weights = tuple(w.detach().cpu().contiguous() for w in call.weights)
    with torch.inference_mode():
        out = tuple(t.clone() for t in call.with_weights(weights)(*probe))
    blobs: list[bytes] = []
    offset = 0

    def put(t: torch.Tensor) -> dict[str, Any]:
        nonlocal offset
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        pad = -offset % _ALIGN
        blobs.append(b"\0" * pad + raw)
        offset += pad
        ref = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "at": offset}
        offset += len(raw)
        return ref

    header = {
        "format": FORMAT,
        "sha256": sha256,
        # The weights file's own hash: a load that finds another bundle SHA-256 can then say
        # whether the weights or only model.toml / a vocabulary changed since.
        "weights_sha256": weights_sha256,
        "torch": torch.__version__,
        "byteorder": sys.byteorder,
        "graph": _encode_graph(call.graph),
        "weights": [put(w) for w in weights],
        "digest": programcache.digest(weights),
        "targets": list(call.targets),
        "parameters": list(call.parameters),
        "facts": {
            "parameter_names": facts.parameter_names,
            "inputs": facts.inputs,
            "max_batch": facts.max_batch,
        },
        "probe": {"in": [put(t) for t in probe], "out": [put(t) for t in out]},
    }
    payload = b"".join(blobs)
    header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + payload


def write(
    folder: Path,
    spec: BundleSpec,
    sha256: str,
    call: programcache.GraphCall,
    facts: programcache.ProgramFacts,
    probe: tuple[torch.Tensor, ...],
) -> Path | None:
    """Write the program file into the bundle ``folder``; None (logged) when the graph is not
    one this format describes."""
    try:
        weights_file = folder / spec.file
        weights = hashlib.sha256(weights_file.read_bytes()).hexdigest()
        data = encode(sha256, call, facts, probe, weights)
    except Unsupported as e:
        logger.info("no program file for %s: %s (it loads through torch.export)", folder, e)
        return None
    except Exception as e:  # a speed-up only: never a reason to refuse a bundle that loads
        logger.warning(
            "no program file for %s: %s: %s (it loads through torch.export)",
            folder,
            type(e).__name__,
            e,
        )
        return None
    path = folder / file_name(spec)
    # Whole or not at all: a run on another machine may be reading the folder (a half-written
    # file would only fail its checksum, but with a warning).
    tmp = folder / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_target(target: str) -> None:
    """A weight's dotted name the rebuilt module gets as attributes (``net.0.weight``): plain
    parts only, none an attribute a module already has."""
    parts = target.split(".")
    if not all(_PART.match(p) for p in parts) or hasattr(torch.fx.GraphModule, parts[0]):
        raise Unsupported(f"weight name {target!r}")
    if parts[0] in ("meta", "graph", "training", "code"):
        raise Unsupported(f"weight name {target!r}")


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, _, name = target._schema.name.partition("::")
        if ns == "aten" and _NAME.match(name) and _NAME.match(target._overloadname):
            return f"aten.{name}.{target._overloadname}"
    for name, fn in _PYTHON_OPS.items():
        if target is fn:
            return name
    raise Unsupported(f"the graph calls {target!r}")


def _enc(v: Any, index: dict[torch.fx.Node, int]) -> Any:
    """A node argument as JSON: a node by its position, a constant tagged with its kind."""
    if isinstance(v, torch.fx.Node):
        return {"node": index[v]}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return {"float": v.hex()}  # exact, and inf and NaN too
    if isinstance(v, (list, tuple)):
        items = [_enc(x, index) for x in v]
        return items if isinstance(v, list) else {"tuple": items}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    for kind, cls in _KINDS.items():
        if isinstance(v, cls):
            return {kind: str(v).removeprefix("torch.")}
    raise Unsupported(f"a constant of type {type(v).__name__}")


def _encode_graph(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    index: dict[torch.fx.Node, int] = {}
    nodes: list[dict[str, Any]] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            nodes.append({"op": "placeholder"})
        elif node.op == "call_function":
            nodes.append(
                {
                    "op": "call_function",
                    "target": _op_name(node.target),
                    "args": _enc(list(node.args), index),
                    "kwargs": {k: _enc(v, index) for k, v in node.kwargs.items()},
                }
            )
        elif node.op == "output":
            nodes.append({"op": "output", "args": _enc(list(node.args), index)})
        else:
            raise Unsupported(f"a {node.op} node")
        index[node] = len(nodes) - 1
    return nodes


# --------------------------------------------------------------------------------------------
# Reading


def load(
    spec: BundleSpec,
    sha256: str,
    options: Mapping[str, Any] | None,
    weights: bytes | None = None,
) -> Any:
    """The bundle's program rebuilt from its program file (a :class:`programcache.Cached`), or
    None: no file (silently), or one that fails a check (with a warning). ``weights``: the
    weights file's bytes, to say what changed when the file was written for another version
    of the bundle."""
    folder = storage.locate(spec.uri, options)
    loc = folder.child(file_name(spec))
    refresh = f"score-catalog bundle check --write-program-file {spec.uri}"
    try:
        data = storage.read_bytes(loc)
    except (FileNotFoundError, NotADirectoryError):
        _stale_files(folder, spec, refresh)
        return None
    except Exception as e:  # unreadable: the slow load, as for a cache
        logger.warning("ignoring the program file %s: cannot read it (%s)", loc.uri, e)
        return None
    try:
        entry = decode(data)
        if entry.get("sha256") != sha256:
            raise ValueError(
                f"written for another bundle (SHA-256 {str(entry.get('sha256'))[:12]}..., this "
                f"bundle's is {sha256[:12]}...): {_what_changed(entry, weights)} after it was "
                f"written; refresh it with `{refresh}`"
            )
        if entry.get("torch") != torch.__version__:
            raise ValueError(
                f"written by torch {entry.get('torch')}, this is {torch.__version__}; refresh "
                f"it with `{refresh}`"
            )
        cached = programcache.rebuild(entry, sha256)
    except Exception as e:
        logger.warning("ignoring the program file %s: %s: %s", loc.uri, type(e).__name__, e)
        return None
    if cached is None:
        logger.warning("ignoring the program file %s: it does not reproduce its probe", loc.uri)
    return cached


def _what_changed(entry: Mapping[str, Any], weights: bytes | None) -> str:
    """Which part of the bundle (its SHA-256 covers model.toml, the weights and every
    vocabulary) changed since the program file was written, as far as the file can tell."""
    recorded = entry.get("weights_sha256")
    if recorded is None or weights is None:
        return "model.toml, a vocabulary or the weights changed"
    if hashlib.sha256(weights).hexdigest() == recorded:
        return "model.toml or a vocabulary changed (the weights are the same)"
    return "the weights changed"


def _stale_files(folder: storage.Location, spec: BundleSpec, refresh: str) -> None:
    """Warn when the bundle has program files for other torch versions only: after a torch
    upgrade every fresh container would otherwise pay torch.export's loader (2-5 s) in
    silence."""
    try:
        others = storage.glob_names(folder, f"{spec.file}.torch")
    except Exception:  # a listing that fails says nothing worth a warning
        return
    names = [o.path.rsplit("/", 1)[-1] for o in others if o.path.endswith(".program")]
    if names:
        logger.warning(
            "model bundle %s: no program file for torch %s (found %s); loading through "
            "torch.export, slower on a machine with an empty cache; write one with `%s`",
            spec.uri,
            torch.__version__,
            ", ".join(names),
            refresh,
        )


def decode(data: bytes) -> dict[str, Any]:
    """A program file's bytes as a program cache entry (the dict :func:`programcache.rebuild`
    checks); ValueError for anything that is not what :func:`encode` writes."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise ValueError("not a score-catalog program file")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    if start + n > len(data):
        raise ValueError("truncated")
    head = json.loads(data[start : start + n])
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError("not a program file this version reads")
    if head.get("byteorder") != sys.byteorder:
        raise ValueError(f"written on a {head.get('byteorder')}-endian machine")
    payload = bytearray(data[start + n :])
    if hashlib.sha256(payload).hexdigest() != head.get("payload_sha256"):
        raise ValueError("its tensors do not match their checksum (a damaged file?)")

    def tensor(ref: Any) -> torch.Tensor:
        dtype = _dtype(ref["dtype"])
        shape = [int(d) for d in ref["shape"]]
        at = int(ref["at"])
        count = dtype.itemsize * int(torch.Size(shape).numel())
        if at < 0 or at % _ALIGN or at + count > len(payload):
            raise ValueError("a tensor lies outside the file")
        if not count:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(payload, dtype=torch.uint8, offset=at, count=count)
        return raw.view(dtype).reshape(shape)

    targets = [str(t) for t in head["targets"]]
    for t in targets:
        _check_target(t)
    facts = head["facts"]
    inputs = facts["inputs"]
    return {
        "format": programcache.FORMAT,
        "sha256": head.get("sha256"),
        "weights_sha256": head.get("weights_sha256"),
        "torch": head.get("torch"),
        "graph": _decode_graph(head["graph"]),
        "weights": [tensor(r) for r in head["weights"]],
        "digest": head["digest"],
        "targets": targets,
        "parameters": [bool(p) for p in head["parameters"]],
        "facts": {
            "parameter_names": None
            if facts["parameter_names"] is None
            else tuple(str(p) for p in facts["parameter_names"]),
            "inputs": None
            if inputs is None
            else tuple(
                (f"torch.{_dtype_name(_dtype(d))}", tuple(_opt_int(s) for s in shape))
                for d, shape in inputs
            ),
            "max_batch": _opt_int(facts["max_batch"]),
        },
        "probe": (
            tuple(tensor(r) for r in head["probe"]["in"]),
            tuple(tensor(r) for r in head["probe"]["out"]),
        ),
    }


def _opt_int(v: Any) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise ValueError(f"{v!r} is not an integer")
    return v


def _dtype(name: Any) -> torch.dtype:
    text = str(name).removeprefix("torch.")
    dtype = getattr(torch, text, None) if _NAME.match(text) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _op(name: Any) -> Any:
    """The function a graph node calls: an aten operation by its name, or one of
    :data:`_PYTHON_OPS`; ValueError for any other name."""
    if name in _PYTHON_OPS:
        return _PYTHON_OPS[name]
    parts = str(name).split(".")
    if len(parts) != 3 or parts[0] != "aten" or not all(_NAME.match(p) for p in parts[1:]):
        raise ValueError(f"the graph calls {name!r}, which is not an aten operation")
    found = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    if not isinstance(found, torch._ops.OpOverload):
        raise ValueError(f"{name!r} is not an aten operation")
    return found


def _dec(v: Any, env: list[torch.fx.Node]) -> Any:
    """A node argument from its JSON (:func:`_enc`); ValueError for anything else."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, list):
        return [_dec(x, env) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise ValueError(f"unknown value {v!r}")
    ((kind, x),) = v.items()
    if kind == "node" and isinstance(x, int) and 0 <= x < len(env):
        return env[x]
    if kind == "float" and isinstance(x, str):
        return float.fromhex(x)
    if kind == "tuple" and isinstance(x, list):
        return tuple(_dec(y, env) for y in x)
    if kind == "device" and isinstance(x, str):
        return torch.device(x)
    if kind in _KINDS and isinstance(x, str) and _NAME.match(x):
        found = getattr(torch, x, None)
        if isinstance(found, _KINDS[kind]):
            return found
    raise ValueError(f"unknown value {v!r} (or a reference to a node before it exists)")


def _call(node: Mapping[str, Any], env: list[torch.fx.Node], graph: torch.fx.Graph) -> Any:
    """A call_function node added to ``graph``, its keywords checked against the schema."""
    target = _op(node["target"])
    kwargs = {str(k): _dec(v, env) for k, v in node["kwargs"].items()}
    if kwargs and (
        not isinstance(target, torch._ops.OpOverload)
        or not set(kwargs) <= {a.name for a in target._schema.arguments}
    ):
        raise ValueError(f"{node['target']} called with unknown keywords {sorted(kwargs)}")
    return graph.call_function(target, tuple(_dec(node["args"], env)), kwargs)


def _decode_graph(nodes: Any) -> torch.fx.GraphModule:
    """The graph :func:`_encode_graph` described: its nodes rebuilt through fx's own API, under
    names of fx's choosing, each call looked up by :func:`_op`."""
    graph = torch.fx.Graph()
    env: list[torch.fx.Node] = []
    outputs = 0
    for i, node in enumerate(nodes):
        op = node["op"]
        if op == "placeholder" and not outputs:
            env.append(graph.placeholder(f"arg{i}"))
        elif op == "call_function" and not outputs:
            env.append(_call(node, env, graph))
        elif op == "output" and not outputs:
            (out,) = _dec(node["args"], env)
            graph.output(out)
            outputs += 1
        else:
            raise ValueError(f"a {op!r} node where none can be")
    if outputs != 1:
        raise ValueError("the graph has no output")
    return torch.fx.GraphModule(torch.nn.Module(), graph)
