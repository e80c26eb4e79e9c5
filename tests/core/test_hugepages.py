"""Huge pages for torch's CPU tensors: asked for before torch is imported, never over the user.

Each case runs in a fresh interpreter: torch reads the variable once, at its first allocation.
"""

from __future__ import annotations

import os
import subprocess
import sys

# With THP_MEM_ALLOC_ENABLE, torch aligns its CPU blocks of 2 MiB and more to the page size and
# advises huge pages for them (64-byte alignment otherwise): five 4 MiB tensors all
# page-aligned is what that looks like from outside.
PAGE_ALIGNED = (
    "import torch; ts = [torch.empty(1 << 20) for _ in range(5)]; "
    "print(all(t.data_ptr() % 4096 == 0 for t in ts))"
)


def _python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.strip()


def test_asked_for_before_torch_is_imported_torch_takes_it() -> None:
    code = (
        f"from pipeline.core import hugepages; print(hugepages.ask_before_torch()); {PAGE_ALIGNED}"
    )
    assert _python(code).splitlines() == ["True", "True"]


def test_without_it_torch_keeps_its_64_byte_alignment() -> None:
    # The control for the test above: the alignment is the variable's doing.
    assert _python(PAGE_ALIGNED) == "False"


def test_a_user_s_zero_is_kept() -> None:
    code = (
        "import os; from pipeline.core import hugepages; print(hugepages.ask_before_torch()); "
        f"print(os.environ['THP_MEM_ALLOC_ENABLE']); {PAGE_ALIGNED}"
    )
    assert _python(code, THP_MEM_ALLOC_ENABLE="0").splitlines() == ["False", "0", "False"]


def test_after_torch_is_imported_nothing_is_set() -> None:
    # Too late to take effect: setting it then would only mislead child processes and logs.
    code = (
        "import os, torch; from pipeline.core import hugepages; "
        "print(hugepages.ask_before_torch()); print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    )
    assert _python(code).splitlines() == ["False", "None"]


def test_the_command_line_asks_before_any_command_imports_torch() -> None:
    # `run --help` runs the group's callback and then stops: torch is never imported.
    code = (
        "import atexit, os, sys; from pipeline.cli.commands import main; "
        "atexit.register(lambda: print(os.environ.get('THP_MEM_ALLOC_ENABLE'), "
        "'torch' in sys.modules)); sys.argv = ['score-catalog', 'run', '--help']; main()"
    )
    assert _python(code).splitlines()[-1] == "1 False"
