"""Tests for pipeline.model.programcache: a bundle loaded a second time, from the cache, computes
what
the first load did, and a cache that is not trustworthy or not intact is never used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.cli.demo import export_bundle
from pipeline.model import programcache
from pipeline.model.export import save_bundle
from pipeline.model.precision import ExecutionOptions, prepare
from pipeline.model.program import LoadedModel, check_batch_size, forget, forward, load_model
from tests.catalog_models import (
    RANKER_INPUTS,
    CountsCalls,
    Ranker,
    SwappedRanker,
    ranker_example,
)
from tests.conftest import bounded_bundle, demo_toml, make_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test starts with an empty cache of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "score-catalog" / "programs"


def entries(root: Path) -> list[Path]:
    return sorted(root.glob("*.pt")) if root.exists() else []


def cold_then_warm(uri: str) -> tuple[LoadedModel, LoadedModel]:
    """The bundle loaded as a first run does, then as a later run does (from the cache)."""
    cold = load_model(uri)
    assert programcache.facts_of(cold.module) is None  # torch.export's own module
    forget(uri)  # this process's loads: the next one goes to the cache
    warm = load_model(uri)
    assert programcache.facts_of(warm.module) is not None, "the second load missed the cache"
    for field in ("sha256", "widths", "out_width", "order", "max_batch"):
        assert getattr(warm, field) == getattr(cold, field), field
    return cold, warm


def assert_same_outputs(cold: LoadedModel, warm: LoadedModel, rows: tuple[int, ...]) -> None:
    for n in rows:
        torch.manual_seed(n)
        xs = cold.example(n, random=True)
        with torch.inference_mode():
            assert torch.equal(forward(warm, xs), forward(cold, xs)), n


class BatchNormAndConstants(nn.Module):
    """BatchNorm statistics, a buffer, a tensor constant and an in-place op on activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.norm = nn.BatchNorm1d(16)
        self.norm.running_mean.uniform_(-1, 1)
        self.norm.running_var.uniform_(0.5, 2)
        self.lin = nn.Linear(16, 3)
        self.register_buffer("shift", torch.linspace(-1, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.norm(x))
        h.add_(self.shift)
        out: torch.Tensor = torch.relu_(h) * torch.tensor([1.0, 2.0, 0.5])
        return out


class Tied(nn.Module):
    """One weight used by two layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.relu(self.b(torch.relu(self.a(x)))))
        return out


class InATuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.inner(x),)


def _bundle(tmp_path: Path, module: nn.Module, name: str = "b") -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation
        return str(export_bundle(module, tmp_path / name, demo_toml(), n_in=16))


@pytest.mark.parametrize(
    "module",
    [make_model(), BatchNormAndConstants(), Tied()],
    ids=["mlp", "batchnorm-constants-inplace", "tied-weights"],
)
def test_a_cached_program_computes_exactly_what_torch_export_s_did(
    module: nn.Module, tmp_path: Path, own_cache: Path
) -> None:
    cold, warm = cold_then_warm(_bundle(tmp_path, module))
    assert len(entries(own_cache)) == 1
    assert_same_outputs(cold, warm, (1, 2, 7, 300, 4096))


class NanForNegatives(nn.Module):
    """NaN wherever the first feature is negative: the random probe rows get NaN too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.lin = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) + torch.log(x[:, :1])
        return out


def test_a_model_that_gives_nan_reproduces_its_probe(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # NaN != NaN: a probe compared with torch.equal would fail, and warn, on every load.
    cold, warm = cold_then_warm(_bundle(tmp_path, NanForNegatives()))
    assert "does not reproduce" not in caplog.text
    x = torch.randn(100, 16)
    with torch.inference_mode():
        a, b = forward(cold, x), forward(warm, x)
    assert a.isnan().any() and torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_nan_inputs_give_the_same_nan_scores(bundle_dir: Path, tmp_path: Path) -> None:
    cold, warm = cold_then_warm(str(shutil.copytree(bundle_dir, tmp_path / "b")))
    x = torch.randn(64, 16)
    x[::3, 5] = float("nan")
    with torch.inference_mode():
        a, b = forward(cold, x), forward(warm, x)
    assert torch.equal(a.isnan(), b.isnan()) and a.isnan().any()
    assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("cls", [Ranker, SwappedRanker], ids=["in-order", "by-name"])
def test_several_typed_inputs_keep_their_names_and_order(
    cls: type[nn.Module], tmp_path: Path
) -> None:
    path = tmp_path / "b"
    save_bundle(
        cls(),
        path,
        inputs=RANKER_INPUTS,
        outputs={"score": "sigmoid"},
        example=ranker_example(),
        name="ranker",
        version="1",
    )
    forget(str(path))  # save_bundle's own check loaded it (and filled the cache)
    warm = load_model(str(path))
    assert programcache.facts_of(warm.module) is not None
    x = ranker_example(50)
    xs = (x["numeric"], x["brand"], x["seller"])
    module = cls().eval()
    with torch.inference_mode():
        want = module(*xs) if cls is Ranker else module(x["seller"], x["numeric"], x["brand"])
        torch.testing.assert_close(forward(warm, xs), want, atol=1e-6, rtol=0)


def test_a_buffer_the_program_mutates_is_the_cached_module_s_own(tmp_path: Path) -> None:
    _, warm = cold_then_warm(_bundle(tmp_path, CountsCalls(make_model())))
    before = int(warm.module.calls)
    with torch.inference_mode():
        forward(warm, torch.randn(3, 16))
        forward(warm, torch.randn(3, 16))
    assert int(warm.module.calls) == before + 2


def test_the_batch_bound_is_kept(tmp_path: Path) -> None:
    _, warm = cold_then_warm(str(bounded_bundle(tmp_path / "b", 1000)))
    assert warm.max_batch == 1000
    with pytest.raises(Exception, match="at most 1,000 rows"):
        check_batch_size(warm, 4096)


def test_int8_rewrites_the_cached_module_as_it_does_torch_s(
    bundle_dir: Path, tmp_path: Path
) -> None:
    cold, warm = cold_then_warm(str(shutil.copytree(bundle_dir, tmp_path / "b")))
    opts = ExecutionOptions("int8")
    a, _ = prepare(cold, opts)
    b, _ = prepare(warm, opts)
    x = torch.randn(200, 16)
    with torch.inference_mode():
        assert torch.equal(forward(a, x), forward(b, x))


def test_a_program_returning_a_tuple_is_not_cached(tmp_path: Path, own_cache: Path) -> None:
    uri = _bundle(tmp_path, InATuple())
    load_model(uri)
    assert entries(own_cache) == []


@pytest.mark.slow
def test_a_warm_load_imports_nothing_of_torch_export(bundle_dir: Path, tmp_path: Path) -> None:
    # The point of the cache: a fresh interpreter loads the bundle without torch._dynamo.
    uri = str(shutil.copytree(bundle_dir, tmp_path / "b"))
    load_model(uri)  # fills the cache (this test's own, through XDG_CACHE_HOME)
    code = (
        "import sys, json; from pipeline.model import programcache; "
        f"from pipeline.model.program import load_model; m = load_model({uri!r}); "
        "print(json.dumps([programcache.facts_of(m.module) is not None, "
        "'torch._dynamo' in sys.modules, 'torch._export.serde.serialize' in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, False]


# --------------------------------------------------------------------------------------------
# A cache that is damaged, foreign or not private is never used


def _warm_entry(bundle_dir: Path, tmp_path: Path, own_cache: Path) -> tuple[str, Path]:
    uri = str(shutil.copytree(bundle_dir, tmp_path / "b"))
    load_model(uri)
    forget(uri)
    (entry,) = entries(own_cache)
    return uri, entry


def test_a_truncated_entry_is_ignored_and_written_again(
    bundle_dir: Path, tmp_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri, entry = _warm_entry(bundle_dir, tmp_path, own_cache)
    reference = load_model(uri)
    forget(uri)
    entry.write_bytes(entry.read_bytes()[:1000])
    m = load_model(uri)
    assert programcache.facts_of(m.module) is None  # loaded the slow way
    assert "ignoring the program cache entry" in caplog.text
    x = torch.randn(50, 16)
    with torch.inference_mode():
        assert torch.equal(forward(m, x), forward(reference, x))
    forget(uri)
    assert programcache.facts_of(load_model(uri).module) is not None  # written again


def test_an_entry_whose_weights_changed_fails_its_probe(
    bundle_dir: Path, tmp_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri, entry = _warm_entry(bundle_dir, tmp_path, own_cache)
    doc = torch.load(entry, weights_only=False)
    doc["weights"][0] = doc["weights"][0] + 1e-3
    doc["digest"] = programcache.digest(tuple(doc["weights"]))  # only the probe can tell
    torch.save(doc, entry)
    os.chmod(entry, 0o600)
    m = load_model(uri)
    assert programcache.facts_of(m.module) is None
    assert "does not reproduce its probe" in caplog.text
    cold = load_model(str(shutil.copytree(bundle_dir, tmp_path / "again")))
    x = torch.randn(20, 16)
    with torch.inference_mode():
        assert torch.equal(forward(m, x), forward(cold, x))


def test_a_damaged_weight_the_probe_does_not_reach_is_caught_by_the_checksum(
    bundle_dir: Path, tmp_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Bit rot in a weight the 8 probe rows never touch (an embedding row no probe id picks):
    # here a changed weight with a probe rewritten to match it, so only the checksum can tell.
    uri, entry = _warm_entry(bundle_dir, tmp_path, own_cache)
    doc = torch.load(entry, weights_only=False)
    doc["weights"][0][0, 0] += 0.5
    call = programcache.GraphCall(
        doc["graph"], tuple(doc["weights"]), tuple(doc["targets"]), tuple(doc["parameters"])
    )
    probe_in, _ = doc["probe"]
    with torch.inference_mode():
        doc["probe"] = (probe_in, tuple(t.clone() for t in call(*probe_in)))
    torch.save(doc, entry)
    m = load_model(uri)
    assert programcache.facts_of(m.module) is None
    assert "do not match their checksum" in caplog.text


def test_a_load_from_the_cache_says_so_in_the_log(
    bundle_dir: Path, tmp_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri, _ = _warm_entry(bundle_dir, tmp_path, own_cache)
    with caplog.at_level("INFO", logger="pipeline.model.program"):
        load_model(uri)
    assert "from the program cache" in caplog.text


def test_an_entry_of_another_bundle_is_not_used(
    bundle_dir: Path, tmp_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, entry = _warm_entry(bundle_dir, tmp_path, own_cache)
    other = _bundle(tmp_path, make_model(seed=9), name="other")
    sha_other = load_model(other).sha256
    forget(other)
    # The other bundle's entry replaced by this one's (a copy under its name).
    shutil.copyfile(entry, programcache.entry_path(sha_other, own_cache))
    m = load_model(other)
    assert programcache.facts_of(m.module) is None
    assert "written for another bundle" in caplog.text


@pytest.mark.parametrize("what", ["folder", "file"])
def test_a_cache_others_can_write_is_not_read(
    what: str,
    bundle_dir: Path,
    tmp_path: Path,
    own_cache: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri, entry = _warm_entry(bundle_dir, tmp_path, own_cache)
    os.chmod(own_cache if what == "folder" else entry, 0o777 if what == "folder" else 0o666)
    m = load_model(uri)
    assert programcache.facts_of(m.module) is None
    assert f"ignoring the program cache {what}" in caplog.text
    assert entry.exists()  # not ours to delete: the user fixes the mode or removes it


def test_an_unwritable_cache_never_stops_a_load(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    uri = str(shutil.copytree(bundle_dir, tmp_path / "b"))
    m = load_model(uri)
    with torch.inference_mode():
        assert forward(m, torch.zeros(3, 16)).shape == (3, 2)


def test_only_the_newest_entries_are_kept(tmp_path: Path, own_cache: Path) -> None:
    uris = [_bundle(tmp_path, make_model(seed=s), name=f"b{s}") for s in range(3)]
    for k, uri in enumerate(uris):
        load_model(uri)
        if k == 0:
            first = entries(own_cache)[0]
            os.utime(first, (1, 1))  # the oldest
    assert len(entries(own_cache)) == 3
    original = programcache.KEEP
    try:
        programcache.KEEP = 2
        load_model(_bundle(tmp_path, make_model(seed=7), name="b7"))
    finally:
        programcache.KEEP = original
    left = entries(own_cache)
    assert len(left) == 2 and first not in left


def test_a_program_with_more_weights_than_the_limit_is_not_cached(
    bundle_dir: Path, tmp_path: Path, own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(programcache, "MAX_BYTES", 1000)  # the demo MLP has ~5 KB of weights
    uri = str(shutil.copytree(bundle_dir, tmp_path / "b"))
    load_model(uri)
    assert entries(own_cache) == []
    monkeypatch.setattr(programcache, "MAX_BYTES", 10**6)
    forget(uri)
    load_model(uri)
    assert len(entries(own_cache)) == 1
