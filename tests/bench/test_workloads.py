"""bench.workloads: the forms a peer runs the bench's models in (what `make bench` hands Daft)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.workloads import load_peer, peer_forms
from pipeline.cli.demo import export_bundle
from tests.conftest import demo_toml

# Each peer_forms call starts a Python that imports torch and torch.export: 10-17 s here.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def peer(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test bundle's peer forms (made in a child process that imports torch: seconds)."""
    return peer_forms(bundle_dir, tmp_path_factory.mktemp("peer") / "forms")


@pytest.mark.parametrize("form", ["eager", "torchscript"])
def test_a_peer_form_scores_as_the_bundle_s_program_does(
    bundle_dir: Path, peer: Path, form: str
) -> None:
    model = load_peer(form, str(peer))
    program = torch.export.load(str(bundle_dir / "model.pt2")).module()
    x = torch.randn(300, 16)
    with torch.inference_mode():
        assert float((model(x) - program(x)).abs().max()) < 1e-6
    if form == "eager":  # plain torch.nn layers: what a team that trained the model holds
        assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]


def test_peer_forms_are_made_once_per_bundle(bundle_dir: Path, peer: Path) -> None:
    made = (peer / "layers.pt").stat().st_mtime_ns
    assert peer_forms(bundle_dir, peer) == peer
    assert (peer / "layers.pt").stat().st_mtime_ns == made


class _Gelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x)))


def test_a_network_that_is_not_linear_and_relu_is_refused(tmp_path: Path) -> None:
    # Rebuilt as Linear + ReLU it would score differently: the bench must not hand a peer
    # another model than the one the CLI scores.
    export_bundle(_Gelu().eval(), tmp_path / "b", demo_toml(), n_in=16)
    with pytest.raises(RuntimeError, match="not a Linear\\+ReLU MLP"):
        peer_forms(tmp_path / "b", tmp_path / "peer")
    assert not (tmp_path / "peer" / "_bench.json").exists()  # not stamped: made again next time
