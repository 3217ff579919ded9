"""Re-parameterised branches (RepVGG, MobileOne) folded into one convolution before pruning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from onnxprune import Ratio, api
from onnxprune.analysis import analyze
from onnxprune.ir.load import import_graph
from onnxprune.normal.fold_branches import deploy_form, has_branches
from tests.onnx_builders import export_torch, run


def _bn(c: int, gen: torch.Generator) -> nn.BatchNorm2d:
    """A BatchNorm with warmed (random) statistics and affine parameters."""
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=gen)
        bn.bias.normal_(0, 0.1, generator=gen)
        bn.running_mean.normal_(0, 0.2, generator=gen)
        bn.running_var.uniform_(0.5, 2.0, generator=gen)
    return bn


class Rep(nn.Module):
    """RepVGG/MobileOne's training-time block: 3x3 and 1x1 convolutions (each with its BatchNorm) and, at stride 1, a
    BatchNorm identity, summed, then ReLU; ``groups`` as MobileOne's depthwise stage."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int, gen: torch.Generator) -> None:
        super().__init__()
        self.k3 = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, groups=groups, bias=False), _bn(cout, gen))
        self.k1 = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, groups=groups, bias=False), _bn(cout, gen))
        self.identity = _bn(cin, gen) if stride == 1 and cin == cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.k3(x) + self.k1(x)
        return torch.relu(y if self.identity is None else y + self.identity(x))


class RepNet(nn.Module):
    """Stem, four re-parameterisable blocks (one at stride 2 without identity, one depthwise), a ResNet-style sum of
    two different inputs that must stay as it is, pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        self.blocks = nn.Sequential(Rep(16, 16, 1, 1, gen), Rep(16, 32, 2, 1, gen), Rep(32, 32, 1, 32, gen),
                                    Rep(32, 32, 1, 1, gen))
        self.side = nn.Conv2d(32, 32, 1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem(x))
        y = torch.relu(self.side(y)) + y  # Add(Relu(Conv(y)), y): not a sum of branches
        return self.fc(y.mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def repnet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export_torch(RepNet().eval(), tmp_path_factory.mktemp("rep") / "repnet.onnx", (1, 3, 32, 32))


def test_a_sum_of_branches_folds_into_one_conv_equal_to_the_original(repnet: Path) -> None:
    """Every re-parameterisable block becomes one Conv (its Adds and identity BatchNorms gone), the ResNet-style
    sum stays, and the folded model computes what the original does to 1e-5 (relative)."""
    model = onnx.load(str(repnet))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Add") == 4 + 3 + 1 and ops.count("BatchNormalization") == 3  # 3 identities
    folded = deploy_form(model)
    ops_after = [n.op_type for n in folded.graph.node]
    assert ops_after.count("Add") == 1 and "BatchNormalization" not in ops_after
    assert ops_after.count("Conv") == 1 + 4 + 1
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    y, y_folded = run(model, input=x)[0], run(folded, input=x)[0]
    assert np.linalg.norm(y_folded - y) / np.linalg.norm(y) < 1e-5
    assert not has_branches(import_graph(folded)) and deploy_form(folded) is folded


class TwoInputs(nn.Module):
    """A 3x3 conv of x beside a 1x1 conv of relu(x), summed: the branches read different tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, 1, 1), nn.Conv2d(3, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(torch.relu(x))


def test_branches_not_over_one_input_are_left_alone(tmp_path: Path) -> None:
    model = onnx.load(str(export_torch(TwoInputs().eval(), tmp_path / "two.onnx", (1, 3, 8, 8))))
    assert not has_branches(import_graph(model)) and deploy_form(model) is model


def test_the_folded_blocks_channels_are_pruned_as_plain_convs(repnet: Path) -> None:
    """Loaded through the API, the blocks' outputs are plain convolutions' channels, no residual streams, and
    compress prunes them."""
    as_given = analyze(onnx.load(str(repnet)))
    loaded = analyze(api.load(str(repnet)))
    assert sum(g.prunable for g in loaded.groups) > sum(g.prunable for g in as_given.groups)
    x = np.random.default_rng(1).standard_normal((32, 3, 32, 32)).astype(np.float32)
    result = api.compress(str(repnet), x, budget=Ratio(0.7))
    assert result.report.macs_after <= 0.7 * result.report.macs_before


def test_weights_that_torch_writes_through_identity_nodes_still_fold(tmp_path: Path) -> None:
    """BatchNorms as initialised (scale 1, shift 0, mean 0, variance 1) share their initializers in the export, each
    reader behind an ``Identity`` of one: the branches fold all the same."""
    torch.manual_seed(0)
    block = Rep(8, 8, 1, 1, torch.Generator().manual_seed(0))
    for bn in (block.k3[1], block.k1[1], block.identity):
        bn.reset_parameters()
        bn.reset_running_stats()
    model = onnx.load(str(export_torch(block.eval(), tmp_path / "rep.onnx", (1, 8, 8, 8))))
    assert "Identity" in {n.op_type for n in model.graph.node}
    folded = deploy_form(model)
    assert [n.op_type for n in folded.graph.node] == ["Conv", "Relu"], [n.op_type for n in folded.graph.node]
    x = np.random.default_rng(0).standard_normal((2, 8, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(folded, input=x)[0], run(model, input=x)[0], rtol=1e-5, atol=1e-5)
