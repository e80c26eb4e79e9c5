"""Transparent huge pages for torch's large CPU tensors, asked for before torch is imported.

A forward pass allocates its activations afresh for every batch (16 MiB a layer for a
1024-wide layer at batch 4096). With glibc's malloc (2.36 here), the aligned blocks torch asks
for are often not reused for the next batch's block of the same size: each batch page-faults
fresh memory in, 4 KiB at a time, and a worker's heap grows and shrinks by hundreds of MB.
torch's own switch ``THP_MEM_ALLOC_ENABLE=1`` makes it page-align its blocks of 2 MiB and more
and advise the kernel to back them with huge pages. Measured on this project's 2-core VM
(medians of 3 alternating runs of the CLI, docs/tuning.md):

- the compute-bound W2 MLP (64-1024-1024-8, batch 4096): 1.28x the rate, 0.42M instead of
  0.75-0.88M minor faults, 3 s instead of 6.4-8 s of kernel time, 0.58 GB peak RSS per
  worker instead of 1.52 GB;
- one 5M-row shard through the demo MLP without the overlap threads: 0.60 GB peak RSS in
  each run, where without huge pages it was 0.70, 1.36 and 1.93 GB;
- the small demo MLP (W1, 4 MiB activations): 5-7% slower (377k against 351k rows/s in 5
  alternating rounds), inside this machine's noise but consistent.

torch reads the variable once, at its first allocation, that is while ``import torch`` runs;
forked Dask workers inherit the value. Where the kernel's THP setting is ``never`` the advice
is ignored and only the alignment remains.
"""

from __future__ import annotations

import os
import sys

ENV = "THP_MEM_ALLOC_ENABLE"


def ask_before_torch() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` unless the user set it or torch is already imported.

    True when huge pages are asked for in this process (by us or by the user).
    """
    if "torch" not in sys.modules:
        os.environ.setdefault(ENV, "1")
    return asked()


def asked() -> bool:
    """Whether this process's environment asks torch for huge pages (forked workers inherit
    it): torch takes ``1`` only, and ignores any other value with a warning."""
    return os.environ.get(ENV, "") == "1"
