"""GhostNet's module (issue 71): a conv's output concatenated with a depthwise conv of itself, then sliced to the
output count, so each of its channels sits twice in the concatenation (the depthwise conv after it loses two groups
a channel), and a residual sum whose 1×1 shortcut conv meets both copies (its two halves are one group).

The oracle is exactness: the channels a test removes are dead (their conv rows and BatchNorm zeroed), so the pruned
model must reproduce the original's outputs in onnxruntime."""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from torch import nn

from models._layers import conv_norm_act
from onnxprune.analysis import analyze
from tests.onnx_builders import compress_dead, export_torch, same_outputs, warm_batchnorms

INIT = 8  # the ghost modules' first conv: half their outputs


def _silence(conv_bn: nn.Sequential, channels: list[int]) -> None:
    """Zero the output ``channels`` of a conv + BatchNorm (weights, scale and shift): they are dead."""
    with torch.no_grad():
        conv_bn[0].weight[channels] = 0
        conv_bn[1].weight[channels] = 0
        conv_bn[1].bias[channels] = 0


class Ghost(nn.Module):
    """timm's GhostModule: a 1×1 conv to INIT channels, a depthwise 3×3 of them, concatenated, sliced."""

    def __init__(self, c_in: int, c_out: int, act: bool) -> None:
        super().__init__()
        self.c_out = c_out
        relu = nn.ReLU if act else None
        self.primary, self.cheap = conv_norm_act(c_in, INIT, 1, act=relu), conv_norm_act(INIT, INIT, groups=INIT, act=relu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.primary(x)
        return torch.cat((y, self.cheap(y)), 1)[:, :self.c_out]


class GhostNetTiny(nn.Module):
    """A stem, a strided ghost bottleneck (ghost module, depthwise conv at stride 2, ghost module without activation,
    plus a 1×1 conv shortcut), a 1×1 conv and a classifier; ``dead`` kills channels of the first ghost module
    (``mid``) or of the residual sum (``stream``: the second ghost module's and both shortcut halves')."""

    def __init__(self, dead: str = "") -> None:
        super().__init__()
        self.stem = conv_norm_act(3, 12)
        self.ghost1, self.dw = Ghost(12, 2 * INIT, True), conv_norm_act(2 * INIT, 2 * INIT, 3, 2, 2 * INIT, act=None)
        self.ghost2, self.shortcut = Ghost(2 * INIT, 2 * INIT, False), conv_norm_act(12, 2 * INIT, 1, 2, act=None)
        self.head, self.fc = conv_norm_act(2 * INIT, 24, 1), nn.Linear(24, 10)
        warm_batchnorms(self)
        if dead == "mid":
            _silence(self.ghost1.primary, [1, 5])
            _silence(self.ghost1.cheap, [1, 5])
        if dead == "stream":
            _silence(self.ghost2.primary, [2, 6])
            _silence(self.ghost2.cheap, [2, 6])
            _silence(self.shortcut, [2, 6, INIT + 2, INIT + 6])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.ghost2(self.dw(self.ghost1(x))) + self.shortcut(x)
        return self.fc(self.head(y).mean((2, 3)))


def _model(dead: str, tmp_path: Path) -> onnx.ModelProto:
    torch.manual_seed(0)
    return onnx.load(str(export_torch(GhostNetTiny(dead).eval(), tmp_path / "ghost.onnx", (1, 3, 16, 16))))


def test_a_ghost_modules_channels_prune_in_both_copies_to_the_masked_original(tmp_path: Path) -> None:
    model = _model("mid", tmp_path)
    groups = {g.name: g for g in analyze(model).groups}
    mid = next(g for name, g in groups.items() if "ghost1/primary" in name)
    assert mid.prunable and mid.channels == INIT, mid.reason
    pruned, _ = compress_dead(model, tmp_path, {mid.name: INIT - 2}, (1, 3, 16, 16), fixed=True)
    same_outputs(pruned, model, (2, 3, 16, 16))


def test_a_shortcut_meeting_both_copies_of_a_ghost_module_is_one_group(tmp_path: Path) -> None:
    """The shortcut conv's outputs [0:8] and [8:16] are added to the same channels (a conv's and its depthwise
    conv's): one group of 8 at two offsets of the shortcut's output, pruned with the ghost module in a stream."""
    model = _model("stream", tmp_path)
    (stream,) = [g for g in analyze(model).groups if "shortcut" in g.name]
    assert stream.prunable and stream.channels == INIT and stream.piece == f"[0:{INIT}]+[{INIT}:{2 * INIT}]"
    pruned, _ = compress_dead(model, tmp_path, {stream.name: INIT - 2}, (1, 3, 16, 16), fixed=True,
                              residual_streams=True)
    same_outputs(pruned, model, (2, 3, 16, 16))
