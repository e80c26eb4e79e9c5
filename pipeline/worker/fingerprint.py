"""The fingerprint of a row: a 64-bit hash of exactly what the model sees of it.

An incremental night (``incremental = true``) carries a row's scores from the baseline only
when its id and this fingerprint match, so the hash is taken over the model's input tensors as
the worker hands them to the model: after the bundle's typing, vocabulary lookup and null fills
(:mod:`pipeline.model.features`). A change the model cannot see (a pass-through column, a
column no input reads, a value that maps to the same vocabulary id) leaves it alone; any change
the model can see changes at least one input byte, and so the hash unless it collides (two
different rows with one 64-bit hash: about 5e-20 per changed row for a well-mixed hash).

Vectorised: each input tensor's rows are viewed as bytes, the bytes of all inputs side by side
are read as 64-bit words, and the words are folded into one hash per row with MurmurHash3's
64-bit mixing steps, one numpy pass over the batch per word: no Python per row. Measured on a
2-core AMD EPYC (avx512f, no AMX; load average 3.6, one torch thread, medians of 30): 4,096 rows
of W1's 16 float32 features (8 words a row) took 0.17 ms against 10.9 ms for the W1 model on the
same batch (1.6%); W2's 64 features (32 words) 0.68 ms against 174 ms (0.4%).

The input's dtypes and shapes are hashed into the seed: the same bytes read as another type are
another input. The bytes are hashed as they are: ``-0.0`` and ``0.0`` differ (a false change,
rescored: never a false match).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

# MurmurHash3 x64's constants (Appleby, public domain): the word mix and the finaliser.
_C1 = np.uint64(0x87C37B91114253D5)
_C2 = np.uint64(0x4CF5AD432745937F)
_M = np.uint64(5)
_N = np.uint64(0x52DCE729)
_F1 = np.uint64(0xFF51AFD7ED558CCD)
_F2 = np.uint64(0xC4CEB9FE1A85EC53)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _fmix(h: np.ndarray) -> np.ndarray:
    h ^= h >> np.uint64(33)
    h *= _F1
    h ^= h >> np.uint64(33)
    h *= _F2
    h ^= h >> np.uint64(33)
    return h


def _seed(inputs: Sequence[np.ndarray]) -> np.uint64:
    """A seed naming the inputs' dtypes and row shapes."""
    layout = ";".join(f"{a.dtype.str}{a.shape[1:]}" for a in inputs).encode()
    return np.uint64(int.from_bytes(hashlib.sha256(layout).digest()[:8], "little"))


def _row_words(inputs: Sequence[np.ndarray], rows: int) -> np.ndarray:
    """(rows, words) uint64: each row's bytes of every input side by side, zero-padded to 8."""
    parts = [np.ascontiguousarray(a).reshape(rows, -1).view(np.uint8) for a in inputs]
    width = sum(p.shape[1] for p in parts)
    pad = -width % 8
    if pad:
        parts.append(np.zeros((rows, pad), np.uint8))
    data = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return np.ascontiguousarray(data).view(np.uint64)


def fingerprints(inputs: Sequence[torch.Tensor | np.ndarray]) -> np.ndarray:
    """One int64 fingerprint per row of the model inputs ``inputs`` (each ``(rows, ...)``, on
    the CPU, in the model's input order)."""
    arrays = [t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t) for t in inputs]
    if not arrays:
        raise ValueError("a fingerprint needs at least one model input")
    rows = int(arrays[0].shape[0])
    if any(int(a.shape[0]) != rows for a in arrays):
        raise ValueError("the model inputs have different row counts")
    words = _row_words(arrays, rows)
    h = np.full(rows, _seed(arrays), dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as the hash means it to
        for j in range(words.shape[1]):
            k = words[:, j] * _C1
            k = _rotl(k, 31) * _C2
            h ^= k
            h = _rotl(h, 27) * _M + _N
        h ^= np.uint64(words.shape[1] * 8)
        h = _fmix(h)
    return h.view(np.int64)
