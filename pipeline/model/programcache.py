"""A private, local cache of loaded exported programs: a bundle loaded before skips torch.export.

``torch.export.load`` imports ``torch._dynamo`` and the export serializer on every run: 0.75 s
of the 1 s a W1 bundle took to load here, on the driver's critical path before the first shard
starts, and most of what separates a 1,000-row job from a bare ``import torch``. So once a
bundle has loaded and passed its dry run, the program's own graph (aten operations only, with
the weights as its first inputs: what :mod:`pipeline.model.program` calls on every batch) and its
weights are saved under the bundle's SHA-256 and torch's version. A later load of the same
bundle rebuilds the same graph from them in milliseconds, importing nothing of torch.export.

Only programs whose graph the run calls directly are cached (weights, then tensor inputs; tensor
outputs; no buffer mutation, tokens or custom objects: :func:`pipeline.model.program._graph_call`
decides); any other program loads the slow way every time. What the run reads from the program
besides its graph (parameter names, input dtypes and shapes, the batch bound) is saved with it, and
the entry keeps the outputs of a probe call: a rebuilt program that does not reproduce them bit for
bit is discarded and the bundle loaded the slow way.

Trust: ``torch.save`` pickles the graph as Python code, and loading a pickle runs code. An
entry is therefore read only from a folder and a file owned by this user that nobody else can
write (ssh's rule for ``~/.ssh``); anything else is ignored with a warning. The entries live in
``$XDG_CACHE_HOME/score-catalog/programs`` (default ``~/.cache/...``); the newest
:data:`KEEP` are kept (programs over :data:`MAX_BYTES` of weights are not cached), and
deleting the folder is always safe: it only costs the next run the slow load. A cache never
stops a run: every problem with it is logged and the slow load used.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT = 1
KEEP = 8  # entries kept, newest first (a load refreshes its entry's time)
# Bigger programs are not kept: their own load takes longer than the 0.75 s the cache saves,
# and each entry is a second copy of the weights on disk.
MAX_BYTES = 2 * 1024**3
FACTS_KEY = "score_catalog_program"  # in a rebuilt GraphModule's ``meta``
PLAIN_OPS = frozenset({"placeholder", "call_function", "output"})  # what a cached graph holds


@dataclass(frozen=True)
class ProgramFacts:
    """What the run reads from an exported program besides its graph (see
    pipeline.model.program)."""

    parameter_names: tuple[str, ...] | None
    inputs: tuple[tuple[str, tuple[int | None, ...]], ...] | None  # (dtype name, shape) each
    max_batch: int | None


class GraphCall:
    """``graph(*weights, *inputs)``: an exported program's own graph, called with the weights
    of the module it belongs to (the same aten operations ``ExportedProgram.module()`` runs,
    without its per-call pytree, guard and hook work). ``targets`` names each weight in the
    module (``net.0.weight``), and ``parameters`` says which of them are parameters."""

    __slots__ = ("_forward", "graph", "parameters", "targets", "weights")

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        weights: tuple[torch.Tensor, ...],
        targets: tuple[str, ...],
        parameters: tuple[bool, ...],
    ) -> None:
        self.graph = graph
        self.weights = weights
        self.targets = targets
        self.parameters = parameters
        self._forward = graph.forward

    def __call__(self, *xs: torch.Tensor) -> Any:
        return self._forward(*self.weights, *xs)

    def with_weights(self, weights: tuple[torch.Tensor, ...]) -> GraphCall:
        """The same graph called with other tensors (the module's, moved, or CPU copies)."""
        return GraphCall(self.graph, weights, self.targets, self.parameters)


def cache_home() -> Path:
    """The folder of this tool's local caches: ``$XDG_CACHE_HOME/score-catalog``, else
    ``~/.cache/score-catalog``. Not a ``SCORE_CATALOG_*`` variable: the config layer rejects
    unknown ones. A relative ``XDG_CACHE_HOME`` is ignored, as the XDG spec requires."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "score-catalog"


def cache_dir() -> Path:
    """Where the programs are kept: ``<cache_home>/programs``."""
    return cache_home() / "programs"


def entry_path(sha256: str, root: Path | None = None) -> Path:
    """Where the program of the bundle with ``sha256`` is kept for this torch version."""
    version = "".join(c if c.isalnum() or c in ".-" else "_" for c in torch.__version__)
    return (root or cache_dir()) / f"{sha256}-torch{version}.pt"


def _private(path: Path, what: str, st: os.stat_result | None = None, *, warn: bool = True) -> bool:
    """Whether ``path`` (``st``: its status, by default its ``lstat``) is owned by this user
    and writable by nobody else; else a warning."""
    st = st if st is not None else path.lstat()
    kind_ok = stat.S_ISDIR(st.st_mode) if what == "folder" else stat.S_ISREG(st.st_mode)
    if not kind_ok or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        (logger.warning if warn else logger.debug)(
            "ignoring the program cache %s %s: it must be a %s owned by you that no one else can "
            "write (the slow load is used; fix its owner or mode, or delete it)",
            what,
            path,
            what,
        )
        return False
    return True


def is_private(path: Path, what: str, st: os.stat_result | None = None) -> bool:
    """Whether ``path`` is this user's alone (the rule for every cache this tool reads code or
    models from: :mod:`pipeline.model.onnxengine` keeps its exports by it too)."""
    return _private(path, what, st)


@dataclass(frozen=True)
class Cached:
    """A cached program rebuilt on the CPU: ``module`` takes the user's inputs only, with the
    weights as its attributes under their own names (as ``ExportedProgram.module()`` has
    them, so that :mod:`pipeline.model.precision`'s int8 rewrite finds each ``aten.linear``'s
    weight), and its ``meta[FACTS_KEY]`` holds its :class:`ProgramFacts`; ``call`` is the
    program's own graph, weights first (moved with the module by :func:`call_of`)."""

    module: torch.fx.GraphModule
    call: GraphCall


def load(sha256: str, root: Path | None = None) -> Cached | None:
    """The cached program of bundle ``sha256``, or None (none kept, not private, unreadable,
    or not reproducing its probe: each but the first with a warning)."""
    path = entry_path(sha256, root)
    try:
        if not path.exists() or not _private(path.parent, "folder"):
            return None
        # Checked on the open file itself, not its name: what is loaded is what was checked.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            if not _private(path, "file", os.fstat(fd)):
                return None
            entry = torch.load(f, map_location="cpu", weights_only=False)
        cached = rebuild(entry, sha256)
    except Exception as e:  # an unreadable, truncated or foreign entry: the slow load
        logger.warning("ignoring the program cache entry %s: %s: %s", path, type(e).__name__, e)
        _remove(path)
        return None
    if cached is None:
        logger.warning("ignoring the program cache entry %s: it does not reproduce its probe", path)
        _remove(path)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # the newest are kept
    return cached


def rebuild(entry: Any, sha256: str) -> Cached | None:
    """The program of a loaded entry (also a bundle's program file:
    :mod:`pipeline.model.sidecar`), or None when it does not reproduce its probe call; ValueError
    when it is not an entry for ``sha256`` on this torch version, or its weights do not match
    their checksum."""
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        raise ValueError("not an entry this version writes")
    if entry.get("sha256") != sha256 or entry.get("torch") != torch.__version__:
        raise ValueError("written for another bundle or torch version")
    graph, weights = entry["graph"], tuple(entry["weights"])
    targets, parameters = tuple(entry["targets"]), tuple(entry["parameters"])
    if (
        not isinstance(graph, torch.fx.GraphModule)
        or not all(isinstance(w, torch.Tensor) for w in weights)
        or not len(weights) == len(targets) == len(parameters)
    ):
        raise ValueError("its graph or weights are not what this version writes")
    if entry.get("digest") != digest(weights):
        raise ValueError("its weights do not match their checksum (a damaged file?)")
    call = GraphCall(graph, weights, targets, parameters)
    probe_in, probe_out = entry["probe"]
    with torch.inference_mode():
        got = call(*probe_in)
    if len(got) != len(probe_out) or not all(
        _same(a, b) for a, b in zip(got, probe_out, strict=True)
    ):
        return None
    return Cached(_unlifted(call, ProgramFacts(**entry["facts"])), call)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit the same values, NaN where the other has NaN (a model may give NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _unlifted(call: GraphCall, facts: ProgramFacts) -> torch.fx.GraphModule:
    """``call``'s graph with its weight inputs turned into attributes of the module."""
    attrs: dict[str, Any] = {}
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    n = 0
    for node in call.graph.graph.nodes:
        if node.op == "placeholder" and n < len(call.weights):
            target, w = call.targets[n], call.weights[n]
            attrs[target] = torch.nn.Parameter(w) if call.parameters[n] else w
            env[node] = new.get_attr(target)
            n += 1
        elif node.op == "output":
            # Only programs returning one bare tensor are kept (pipeline.model.program._keep): the
            # module returns it as ExportedProgram.module() does, not in the graph's tuple.
            (only,) = node.args[0]
            new.output(env[only])
        else:
            env[node] = new.node_copy(node, lambda x: env[x])
    module = torch.fx.GraphModule(attrs, new)
    module.meta[FACTS_KEY] = facts
    return module


def facts_of(module: Any) -> ProgramFacts | None:
    """The :class:`ProgramFacts` of a module :func:`load` rebuilt; None for any other."""
    meta = getattr(module, "meta", None) if isinstance(module, torch.fx.GraphModule) else None
    facts = meta.get(FACTS_KEY) if isinstance(meta, dict) else None
    return facts if isinstance(facts, ProgramFacts) else None


def call_of(cached: Cached) -> GraphCall:
    """The direct call of ``cached``'s graph with its module's weights, wherever ``.to()``
    moved them."""
    module = cached.module
    return cached.call.with_weights(
        tuple(operator.attrgetter(t)(module) for t in cached.call.targets)
    )


def save(
    sha256: str, call: GraphCall, facts: ProgramFacts, probe: tuple[torch.Tensor, ...]
) -> None:
    """Keep ``call``'s graph and weights (copied to the CPU) for bundle ``sha256``, with the
    outputs it gives for ``probe`` (CPU inputs); errors are logged, never raised."""
    root = cache_dir()
    path = entry_path(sha256, root)
    if any(n.op not in PLAIN_OPS for n in call.graph.graph.nodes):
        return  # a submodule or attribute in the graph (control flow): not rebuilt here
    size = sum(w.numel() * w.element_size() for w in call.weights)
    if size > MAX_BYTES:
        logger.debug("not caching the program of %s: %d bytes of weights", sha256[:12], size)
        return
    try:
        weights = tuple(w.detach().cpu() for w in call.weights)
        cpu_call = call.with_weights(weights)
        with torch.inference_mode():
            out = tuple(t.clone() for t in cpu_call(*probe))
        entry = {
            "format": FORMAT,
            "sha256": sha256,
            "torch": torch.__version__,
            "graph": call.graph,
            "weights": list(weights),
            "digest": digest(weights),
            "targets": list(call.targets),
            "parameters": list(call.parameters),
            "facts": facts.__dict__,
            "probe": (probe, out),
        }
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(root, "folder", warn=False):  # the load has said so already
            return
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".pt")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(entry, f)
            os.replace(tmp, path)
        except BaseException:
            _remove(Path(tmp))
            raise
        _evict(root)
    except Exception as e:
        logger.debug("could not save the program cache entry %s: %s", path, e)


def digest(weights: tuple[torch.Tensor, ...]) -> str:
    """SHA-256 over every weight's dtype, shape and bytes: a weight the probe does not reach
    (an embedding row none of its ids picks) is checked too."""
    h = hashlib.sha256()
    for w in weights:
        t = w.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _evict(root: Path) -> None:
    """Keep the :data:`KEEP` newest entries."""
    entries = sorted(
        (p for p in root.glob("*-torch*.pt") if not p.name.startswith(".")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in entries[KEEP:]:
        _remove(old)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
