"""ONNX Runtime as an optional CPU engine (``engine = "onnx"``): the bundle's program exported
to ONNX once, checked against torch, and run by ONNX Runtime's CPU provider in every worker.

Why: on a 2-core AMD EPYC (avx2, avx512f, avx512_bf16, avx512_vnni, no AMX) the W1 MLP
(16-256-128-2) ran 1.62x faster per call under ONNX Runtime 1.32 than under torch 2.13 at batch
4,096, one thread (torch's 256-wide activations there no longer fit the core's cache), 1.12x at
1,024, and whole W1 runs 1.04x and 1.23x faster (wall, pair by pair, two rounds on a busy
machine; 1.17-1.25x fewer CPU seconds); the compute-bound W2 MLP (64-1024-1024-8) gained
nothing (0.92-1.06x per call, 0.95x a whole run). See docs/tuning.md#onnx-runtime-engine.
So it is opt-in, never the default, and torch stays the reference: :func:`prepare_onnx` is
called by :func:`pipeline.model.precision.prepare`, and the driver checks the result against
torch on real rows before anything is scored (``pipeline.driver.execution``).

The export (``torch.onnx.export``, 2-6 s on 2 cores, most of it importing the exporter) is kept
in ``$XDG_CACHE_HOME/score-catalog/onnx`` under the bundle's SHA-256, its input widths and the
torch, onnxscript and onnxruntime versions, written whole or not at all, and read only from a
folder and a file that are this user's alone (as the program cache is). An ONNX file is a
protobuf, not a pickle; a damaged one that ONNX Runtime cannot load is exported again, and one
that loads but scores differently is caught by the parity check.

ONNX Runtime sessions are made per process and per thread count, lazily, with as many intra-op
threads as the process has torch threads (a worker's share of the cores), and dropped before a
fork: a forked child never inherits a session whose thread pool it does not have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import tempfile
import threading
import warnings
import weakref
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.config import ONNX_PACKAGES, missing_packages
from pipeline.core.errors import ConfigError, ModelError
from pipeline.model import programcache
from pipeline.model.program import LoadedModel, callable_of

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'score-catalog[onnx]'"
EXAMPLE_ROWS = 4  # rows of the example the export traces (the batch dimension stays dynamic)


def require() -> None:
    """Refuse ``engine = "onnx"`` where its packages are not installed (exit 2)."""
    missing = missing_packages(ONNX_PACKAGES)
    if missing:
        raise ConfigError(
            f"engine = 'onnx' needs {', '.join(missing)}, which is not installed here: "
            f"{INSTALL_HINT}, or use engine 'torch' (the default)"
        )


def _versions() -> str:
    parts = []
    for name in ("torch", "onnxscript", "onnxruntime"):
        try:
            v = version(name)
        except PackageNotFoundError:
            v = "none"
        parts.append(name + "".join(c if c.isalnum() or c in ".-" else "_" for c in v))
    return "-".join(parts)


def cache_path(model: LoadedModel, root: Path | None = None) -> Path:
    """Where the ONNX export of ``model`` is kept for these package versions."""
    widths = hashlib.sha256(repr((model.widths, model.order)).encode()).hexdigest()[:12]
    folder = root or (programcache.cache_home() / "onnx")
    return folder / f"{model.sha256}-{widths}-{_versions()}.onnx"


class _Program(torch.nn.Module):
    """What the scoring loop calls (``program.forward``), as a module the exporter traces: the
    inputs in call order, one (batch, n) tensor out."""

    def __init__(self, model: LoadedModel) -> None:
        super().__init__()
        self.call = callable_of(model.module)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = self.call(*xs)
        if isinstance(out, (tuple, list)) and len(out) == 1:
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError("the model does not return one tensor")
        return out.unsqueeze(1) if out.dim() == 1 else out


def export(model: LoadedModel) -> bytes:
    """``model``'s program as an ONNX model (bytes) with a dynamic batch dimension; ModelError,
    naming the reason, when it does not export."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        example = model.example(EXAMPLE_ROWS, random=True, device="cpu")
    xs = tuple(example[i] for i in model.order)
    dynamic = (tuple({0: torch.export.Dim.DYNAMIC} for _ in xs),)
    # The exporter prints its progress and warns about what it does not need (torchvision):
    # none of it is the user's business unless it fails, and then the error says what.
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                _Program(model), xs, dynamo=True, dynamic_shapes=dynamic, verbose=False
            )
            if program is None:  # only when asked to write a file, which this does not
                raise RuntimeError("torch.onnx.export returned no program")
            data: bytes = program.model_proto.SerializeToString()
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if ln.startswith("<class")), lines[0] if lines else "")
        raise ModelError(
            f"model bundle {model.spec.uri}: engine 'onnx' cannot use this model: "
            f"torch.onnx.export failed ({type(e).__name__}: {why[:300]}); nothing was scored. "
            "Use engine 'torch' (the default) for this bundle."
        ) from e
    finally:
        exporter_log.setLevel(level)
    return data


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_cached(path: Path) -> bytes | None:
    """The kept export, or None: missing, not private, unreadable, or not the bytes that were
    written (its SHA-256 is kept beside it: an initializer edited in the file scored with the
    wrong weights, and the parity check's first 2,048 rows never read that embedding row)."""
    try:
        if not path.exists() or not programcache.is_private(path.parent, "folder"):
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            if not programcache.is_private(path, "file", os.fstat(fd)):
                return None
            data = f.read()
        want = _checksum_path(path).read_text(encoding="ascii").strip()
    except OSError as e:
        logger.warning("ignoring the ONNX export %s: %s: exporting again", path, e)
        return None
    if hashlib.sha256(data).hexdigest() != want:
        logger.warning(
            "ignoring the ONNX export %s: its bytes do not match the SHA-256 kept with it "
            "(changed after it was written): exporting again",
            path,
        )
        return None
    return data


def _write_cached(path: Path, data: bytes) -> None:
    """Keep the export: a temporary file renamed over the entry, so no reader sees half."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".onnx")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            # The checksum first: a reader that finds the new export finds its checksum too.
            _checksum_path(path).write_text(hashlib.sha256(data).hexdigest() + "\n", "ascii")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except OSError as e:  # a cache never stops a run: the next run exports again
        logger.warning("could not keep the ONNX export in %s: %s", path.parent, e)


# Every engine module of this process, so that a fork can drop their sessions first.
_MODULES: weakref.WeakSet[OnnxModule] = weakref.WeakSet()


class OnnxModule:
    """Calls an ONNX model like the program it was exported from: torch tensors in (call
    order), one torch tensor out."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._sessions: dict[tuple[int, int], tuple[Any, tuple[str, ...]]] = {}
        self._lock = threading.Lock()
        _MODULES.add(self)

    def session(self) -> tuple[Any, tuple[str, ...]]:
        """This process's session for its current torch thread count, and its input names."""
        key = (os.getpid(), torch.get_num_threads())
        found = self._sessions.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._sessions.get(key)
            if found is None:
                found = _session(self.data, key[1])
                self._sessions[key] = found
            return found

    def drop_sessions(self) -> None:
        """Forget every session (one being run stays alive until that call returns)."""
        with self._lock:
            self._sessions = {}

    def __call__(self, *xs: torch.Tensor) -> torch.Tensor:
        sess, names = self.session()
        feeds = {
            n: np.ascontiguousarray(x.detach().cpu().numpy())
            for n, x in zip(names, xs, strict=True)
        }
        return torch.from_numpy(sess.run(None, feeds)[0])


def _session(data: bytes, threads: int) -> tuple[Any, tuple[str, ...]]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3  # errors only: its warnings are about graph rewrites it made
    sess = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    return sess, tuple(i.name for i in sess.get_inputs())


def _before_fork() -> None:
    for module in list(_MODULES):
        module.drop_sessions()


def _in_child() -> None:
    # A lock another parent thread held at the fork stays held in the child: start afresh.
    for module in list(_MODULES):
        module._lock = threading.Lock()
        module._sessions = {}


os.register_at_fork(before=_before_fork, after_in_child=_in_child)


def prepare_onnx(model: LoadedModel) -> LoadedModel:
    """``model`` run by ONNX Runtime: its export from the cache, or exported now and kept.

    ConfigError for a device other than the CPU; ModelError for a model that does not export.
    """
    require()
    if model.device.type != "cpu":
        raise ConfigError(
            f"engine 'onnx' runs on the CPU only, not on {model.device}; use --device cpu, or "
            "engine 'torch' on CUDA"
        )
    path = cache_path(model)
    data = _read_cached(path)
    if data is not None:
        try:
            module = OnnxModule(data)
            module.session()
        except Exception as e:
            logger.warning("ignoring the ONNX export %s (%s): exporting again", path, e)
            data = None
    if data is None:
        data = export(model)
        module = OnnxModule(data)
        try:
            module.session()
        except Exception as e:
            raise ModelError(
                f"model bundle {model.spec.uri}: engine 'onnx': ONNX Runtime cannot load the "
                f"model's export ({type(e).__name__}: {str(e)[:300]}); nothing was scored. "
                "Use engine 'torch' (the default) for this bundle."
            ) from e
        _write_cached(path, data)
        logger.info("exported model %s to ONNX (kept in %s)", model.spec.name, path.parent)
    return dataclasses.replace(model, module=module)
