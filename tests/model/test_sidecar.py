"""Tests for pipeline.model.sidecar: save_bundle writes the program cache's entry next to the
bundle, a machine with an empty cache loads from it what torch.export's loader would, and a
program file that is foreign, damaged or tampered with is never used (nor able to run code)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeline.model import programcache, sidecar
from pipeline.model.bundle import read_bundle
from pipeline.model.export import save_bundle
from pipeline.model.program import (
    LoadedModel,
    check_batch_size,
    forget,
    forward,
    load_model,
    write_program_file,
)
from tests.catalog_models import RANKER_INPUTS, Ranker, ranker_example
from tests.conftest import bounded_bundle, make_model
from tests.integration.helpers import cli
from tests.model.test_programcache import BatchNormAndConstants, Tied

REPO = Path(__file__).resolve().parents[2]
COLUMNS = {"features": {"columns": [f"f{i}" for i in range(16)]}}


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test starts with an empty program cache of its own, as a fresh container does."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "score-catalog" / "programs"


def saved(tmp_path: Path, module: nn.Module, name: str = "b") -> Path:
    path = tmp_path / name
    save_bundle(
        module,
        path,
        inputs=COLUMNS,
        outputs={"score": "softmax:1"} if name != "raw" else {"out": "raw"},
        example=torch.randn(64, 16, generator=torch.Generator().manual_seed(1)),
        name="m",
        version="1",
    )
    return path


def program_file(bundle: Path) -> Path:
    (found,) = bundle.glob("*.program")
    return found


def fresh_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, uri: Path) -> None:
    """What a machine that never loaded ``uri`` sees: no load in this process, an empty cache."""
    forget(str(uri))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"fresh-{os.urandom(4).hex()}"))


def slow_load(uri: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LoadedModel:
    """The bundle as torch.export's loader gives it (a copy without its program file)."""
    bare = tmp_path / f"bare-{uri.name}"
    shutil.copytree(uri, bare, ignore=shutil.ignore_patterns("*.program"))
    fresh_machine(monkeypatch, tmp_path, bare)
    m = load_model(str(bare))
    assert programcache.facts_of(m.module) is None
    return m


def loads_from_program_file(
    uri: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> LoadedModel:
    fresh_machine(monkeypatch, tmp_path, uri)
    with caplog.at_level("INFO", logger="pipeline.model.program"):
        m = load_model(str(uri))
    assert "from its program file" in caplog.text
    assert programcache.facts_of(m.module) is not None
    return m


@pytest.mark.parametrize(
    "module",
    [make_model(), BatchNormAndConstants(), Tied()],
    ids=["mlp", "batchnorm-constants-inplace", "tied-weights"],
)
def test_a_fresh_machine_loads_the_program_file_and_computes_what_torch_export_does(
    module: nn.Module,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri = saved(tmp_path, module, "raw")
    fast = loads_from_program_file(uri, tmp_path, monkeypatch, caplog)
    slow = slow_load(uri, tmp_path, monkeypatch)
    for field in ("sha256", "widths", "out_width", "order", "max_batch"):
        assert getattr(fast, field) == getattr(slow, field), field
    for n in (1, 2, 7, 300, 4096):
        xs = slow.example(n, random=True)
        with torch.inference_mode():
            assert torch.equal(forward(fast, xs), forward(slow, xs)), n


def test_several_typed_inputs_keep_their_names_and_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = tmp_path / "ranker"
    save_bundle(
        Ranker(),
        uri,
        inputs=RANKER_INPUTS,
        outputs={"score": "sigmoid"},
        example=ranker_example(),
        name="ranker",
        version="1",
    )
    fast = loads_from_program_file(uri, tmp_path, monkeypatch, caplog)
    x = ranker_example(50)
    xs = (x["numeric"], x["brand"], x["seller"])
    with torch.inference_mode():
        torch.testing.assert_close(forward(fast, xs), Ranker().eval()(*xs), atol=1e-6, rtol=0)


def test_the_program_file_does_not_change_the_bundle_s_identity(tmp_path: Path) -> None:
    uri = saved(tmp_path, make_model())
    with_file = read_bundle(str(uri))[2]
    program_file(uri).unlink()
    assert read_bundle(str(uri))[2] == with_file


def test_a_fresh_process_loads_it_without_torch_export(tmp_path: Path) -> None:
    # The point: a new container (empty XDG_CACHE_HOME) imports nothing of torch.export.
    uri = saved(tmp_path, make_model())
    code = (
        "import sys, json; from pipeline.model import programcache; "
        f"from pipeline.model.program import load_model; m = load_model({str(uri)!r}); "
        "print(json.dumps([programcache.facts_of(m.module) is not None, "
        "'torch._dynamo' in sys.modules, 'torch._export.serde.serialize' in sys.modules]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "empty")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=REPO
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, False]


def test_a_program_returning_a_tuple_gets_no_program_file(tmp_path: Path) -> None:
    class InATuple(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.inner(x),)

    uri = saved(tmp_path, InATuple())
    assert list(uri.glob("*.program")) == []


# --------------------------------------------------------------------------------------------
# A program file that is foreign, damaged or tampered with is ignored with a warning


def rewrite(path: Path, change: Callable[[dict[str, Any], bytearray], None]) -> None:
    """Change a program file's header and tensors, with its payload checksum made to match
    (as someone editing it on purpose would)."""
    data = path.read_bytes()
    start = len(sidecar.MAGIC) + 8
    (n,) = struct.unpack_from("<Q", data, len(sidecar.MAGIC))
    head = json.loads(data[start : start + n])
    payload = bytearray(data[start + n :])
    change(head, payload)
    head["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    raw = json.dumps(head).encode()
    path.write_bytes(sidecar.MAGIC + struct.pack("<Q", len(raw)) + raw + bytes(payload))


def ignored(
    uri: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> LoadedModel:
    """Load ``uri`` on a fresh machine: its program file must be ignored with a warning, and
    the bundle loaded by torch.export, scoring what it scores without the file."""
    fresh_machine(monkeypatch, tmp_path, uri)
    m = load_model(str(uri))
    assert programcache.facts_of(m.module) is None  # torch.export's own module
    assert "ignoring the program file" in caplog.text
    assert program_file(uri).exists()  # the user's file: never deleted
    slow = slow_load(uri, tmp_path, monkeypatch)
    x = torch.randn(40, 16)
    with torch.inference_mode():
        assert torch.equal(forward(m, x), forward(slow, x))
    return m


def test_a_program_file_for_another_torch_version_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = saved(tmp_path, make_model())

    def older(head: dict[str, Any], _: bytearray) -> None:
        head["torch"] = "2.12.0"

    rewrite(program_file(uri), older)
    ignored(uri, tmp_path, monkeypatch, caplog)
    assert f"written by torch 2.12.0, this is {torch.__version__}" in caplog.text
    assert "bundle check --write-program-file" in caplog.text  # how to refresh it


def test_a_bundle_with_program_files_for_other_torch_versions_only_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # After a torch upgrade the file's name no longer matches: every fresh container would pay
    # torch.export's loader without a word (a break-it review).
    uri = saved(tmp_path, make_model())
    old = program_file(uri)
    old.rename(old.with_name("model.pt2.torch2.12.0_cpu.program"))
    fresh_machine(monkeypatch, tmp_path, uri)
    with caplog.at_level(logging.WARNING):
        m = load_model(str(uri))
    assert programcache.facts_of(m.module) is None  # torch.export's loader
    assert "no program file for torch" in caplog.text
    assert "model.pt2.torch2.12.0_cpu.program" in caplog.text
    assert "bundle check --write-program-file" in caplog.text
    assert "Location(" not in caplog.text


def test_another_bundle_s_program_file_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = saved(tmp_path, make_model(seed=1))
    other = saved(tmp_path, make_model(seed=2), name="other")
    shutil.copyfile(program_file(other), program_file(uri))
    ignored(uri, tmp_path, monkeypatch, caplog)
    assert "another bundle" in caplog.text
    assert "the weights changed after it was written" in caplog.text


def test_an_edited_model_toml_is_not_called_a_weights_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = saved(tmp_path, make_model(seed=1))
    toml = uri / "model.toml"
    toml.write_text(toml.read_text().replace('version = "1"', 'version = "1b"'))
    ignored(uri, tmp_path, monkeypatch, caplog)
    assert "model.toml or a vocabulary changed (the weights are the same)" in caplog.text
    assert "the weights changed" not in caplog.text


def test_a_truncated_program_file_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = saved(tmp_path, make_model())
    path = program_file(uri)
    path.write_bytes(path.read_bytes()[:-100])
    ignored(uri, tmp_path, monkeypatch, caplog)
    assert "checksum" in caplog.text


def test_changed_weights_are_caught_by_their_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = saved(tmp_path, make_model())

    def bump(head: dict[str, Any], payload: bytearray) -> None:
        payload[head["weights"][0]["at"]] ^= 0x40

    rewrite(program_file(uri), bump)
    ignored(uri, tmp_path, monkeypatch, caplog)
    assert "do not match their checksum" in caplog.text


def test_a_changed_graph_fails_its_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = saved(tmp_path, make_model())

    def swap(head: dict[str, Any], _: bytearray) -> None:
        calls = [n for n in head["graph"] if n.get("target") == "aten.relu.default"]
        assert calls, head["graph"]
        calls[0]["target"] = "aten.sigmoid.default"

    rewrite(program_file(uri), swap)
    ignored(uri, tmp_path, monkeypatch, caplog)
    assert "does not reproduce its probe" in caplog.text


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("target", "builtins.exec"),
        ("target", "aten.relu.default; import os"),
        ("weight", 'net.0.weight"); __import__("os").system("touch PWNED'),
        ("weight", "forward"),
        ("kwarg", 'x=1) or __import__("os").system("touch PWNED") or (y'),
    ],
)
def test_a_program_file_that_names_code_is_refused_without_running_it(
    where: str,
    value: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Not a pickle: a name in it is looked up among aten operations and checked against their
    # schemas, never imported, evaluated or written into generated code.
    uri = saved(tmp_path, make_model())
    monkeypatch.chdir(tmp_path)

    def plant(head: dict[str, Any], _: bytearray) -> None:
        call = next(n for n in head["graph"] if n["op"] == "call_function")
        if where == "target":
            call["target"] = value
        elif where == "weight":
            head["targets"][0] = value
        else:
            call["kwargs"][value] = 1

    rewrite(program_file(uri), plant)
    ignored(uri, tmp_path, monkeypatch, caplog)
    assert not (tmp_path / "PWNED").exists()


# --------------------------------------------------------------------------------------------
# score-catalog bundle check --write-program-file: for bundles exported by hand


def test_bundle_check_writes_the_program_file_of_a_bundle_exported_by_hand(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = shutil.copytree(bundle_dir, tmp_path / "by-hand")  # torch.export.save + model.toml
    assert list(uri.glob("*.program")) == []
    res = cli("bundle", "check", str(uri), "--write-program-file")
    assert res.returncode == 0, res.output
    written = program_file(uri)
    assert f"wrote {written}" in res.stdout
    assert written.name == sidecar.file_name(read_bundle(str(uri))[0])
    # A fresh machine now loads it from the file, computing what torch.export's load does.
    fresh_machine(monkeypatch, tmp_path, uri)
    fast = load_model(str(uri))
    assert programcache.facts_of(fast.module) is not None
    slow = slow_load(uri, tmp_path, monkeypatch)
    x = torch.randn(100, 16)
    with torch.inference_mode():
        assert torch.equal(forward(fast, x), forward(slow, x))


def test_the_batch_bound_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = bounded_bundle(tmp_path / "bounded", 1000)
    assert write_program_file(load_model(str(uri)), uri) is not None
    assert [p.name for p in uri.iterdir() if p.name.startswith(".")] == []  # no temporary left
    fresh_machine(monkeypatch, tmp_path, uri)
    fast = load_model(str(uri))
    assert programcache.facts_of(fast.module) is not None and fast.max_batch == 1000
    with pytest.raises(Exception, match="at most 1,000 rows"):
        check_batch_size(fast, 4096)
