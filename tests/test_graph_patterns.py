"""ConvTranspose as producer and consumer, Resize on the way to a skip Concat: groups found, slicing
equals the masked original in onnxruntime, and compress writes a smaller model that runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.onnx_builders import GraphBuilder, compress_dead, kill, same_outputs
from tests.test_concat_split import check, groups_of


def conv_transpose(b: GraphBuilder, x: str, name: str, cin: int, cout: int, k: int = 2, stride: int = 2,
                   **attrs) -> str:
    w = b.rand(f"{name}.w", (cin, cout, k, k), (1.0 / (cin * k * k)) ** 0.5)
    return b.op("ConvTranspose", [x, w, b.rand(f"{name}.b", (cout,), 0.1)], name, kernel_shape=[k, k],
                strides=[stride, stride], **attrs)


def decoder_net() -> tuple[GraphBuilder, str]:
    """enc (stride 2) → ConvTranspose up (consumer of enc, producer of its own channels) → BN/ReLU →
    Concat with the Resize of a side branch and the input-level skip → head."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    skip = b.op("Relu", [b.conv("x", "skip", 3, 6)], "rs")
    enc = b.op("Relu", [b.conv(skip, "enc", 6, 10, stride=2)], "re")
    up = b.op("Relu", [b.bn(conv_transpose(b, enc, "up", 10, 8, pads=[0, 0, 0, 0]), "bnu", 8)], "ru")
    side = b.conv(enc, "side", 10, 4, k=1)
    scales = b.const("scales", np.array([1, 1, 2, 2], np.float32))
    resized = b.op("Resize", [side, "", scales], "resize", mode="nearest")
    cat = b.op("Concat", [up, resized, skip], "cat", axis=1)
    return b, b.conv(cat, "head", 18, 3)


def test_decoder_groups() -> None:
    b, out = decoder_net()
    groups = {name: gs[0] for name, gs in groups_of(b, [out]).items()}
    assert [c.node for c in groups["enc"].consumers] == ["up", "side"]
    assert [c.node for c in groups["up"].consumers] == ["head"] and groups["up"].prunable
    assert groups["side"].prunable and "resize_out" in groups["side"].tensors
    assert sorted(c.node for c in groups["skip"].consumers) == ["enc", "head"]
    assert groups["skip"].offsets["cat_out"] == [12]


@pytest.mark.parametrize("order", [["enc"], ["up"], ["side", "skip"], ["skip", "up", "enc", "side"]])
def test_decoder_slicing_equals_masked_original(order: list[str]) -> None:
    b, out = decoder_net()
    check(b.model([out]), order)


def test_conv_transpose_with_output_padding_is_a_consumer() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "a", 3, 6)], "r")
    out = conv_transpose(b, y, "up", 6, 2, k=3, pads=[1, 1, 1, 1], output_padding=[1, 1])
    check(b.model([out]), ["a"])


def test_conv_transpose_blockers_show_their_reason() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.conv("x", "a", 3, 6)
    out = conv_transpose(b, y, "up", 6, 2, k=2, auto_pad="SAME_UPPER")
    z = b.conv("x", "c", 3, 4)
    w = b.rand("g.w", (4, 1, 2, 2))
    grouped = b.op("ConvTranspose", [z, w], "g", kernel_shape=[2, 2], strides=[2, 2], group=2)
    groups = groups_of(b, [out, grouped])
    assert "auto_pad" in groups["a"][0].reason
    assert "grouped" in groups["c"][0].reason


def test_compress_decoder_writes_a_smaller_equivalent_model(tmp_path: Path) -> None:
    """Half of every group's channels are dead (the ConvTranspose's through its BatchNormalization): pruning
    to half the width must remove exactly those, through the Resize and the skip Concat, and keep the outputs."""
    b, out = decoder_net()
    model = kill(b.model([out]), {"skip": [0, 2, 5], "enc": [1, 3, 4, 7, 9], "bnu": [0, 2, 5, 6], "side": [1, 2]})
    pruned, report = compress_dead(model, tmp_path, {"skip": 3, "enc": 5, "up": 4, "side": 2}, (1, 3, 8, 8),
                                   samples=32)
    onnx.checker.check_model(pruned)
    assert report.macs_after < 0.5 * report.macs_before
    same_outputs(pruned, model, (4, 3, 8, 8))
