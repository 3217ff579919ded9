"""What ``compress`` writes beside the weights: the exporter's metadata, and which original channels each narrowed
tensor holds (``ir.kept``)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from onnxprune.calib.sources import ArraySet
from onnxprune.ir.kept import narrow, read_kept, write_kept
from onnxprune.ir.load import import_graph
from onnxprune.pipeline import compress
from onnxprune.recovery import RecoverOptions, recover
from onnxprune.ir.cuts import run_segment
from onnxprune.strategies import Epsilon, Local, NoRefit, Ratio, options_from
from tests.onnx_builders import export_torch


def test_narrow_composes_and_the_map_survives_the_metadata() -> None:
    kept: dict = {}
    narrow(kept, {"a": np.array([0, 2, 3, 5, 6, 7])}, {"a": 1})
    narrow(kept, {"a": np.array([1, 2, 5]), "b": np.array([4])}, {"a": 1, "b": 0})
    assert kept["a"][0] == 1 and kept["a"][1].tolist() == [2, 3, 7]
    model = onnx.ModelProto()
    model.metadata_props.add(key="other", value="x")
    back = read_kept(write_kept(write_kept(model, {"z": (0, np.array([9]))}), kept))
    assert sorted(back) == ["a", "b"] and [p.key for p in model.metadata_props] == ["other", "onnxprune.kept"]
    assert back["a"][1].tolist() == [2, 3, 7] and back["b"][0] == 0 and back["b"][1].tolist() == [4]
    assert read_kept(onnx.ModelProto()) == {}


class LongSkip(torch.nn.Module):
    """A stem whose output reaches a Concat past four 3x3 convs (a U-Net's or an FPN's skip): the Concat's tensor
    holds two groups' channels side by side, so its entry's indices run past the first group's."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.body = torch.nn.ModuleList(torch.nn.Conv2d(8 if i == 0 else 12, 12, 3, padding=1) for i in range(4))
        self.merge = torch.nn.Conv2d(20, 16, 1)
        self.fc = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.stem(x))
        y = s
        for conv in self.body:
            y = torch.relu(conv(y))
        y = torch.relu(self.merge(torch.cat([y, s], 1)))
        return self.fc(y.mean((2, 3)))


@pytest.fixture(scope="module")
def skip(tmp_path_factory: pytest.TempPathFactory) -> tuple[onnx.ModelProto, onnx.ModelProto, np.ndarray]:
    """The teacher, the student at half its MACs (local imitation, no refit) and 64 samples."""
    torch.manual_seed(0)
    teacher = onnx.load(str(export_torch(LongSkip(), tmp_path_factory.mktemp("skip") / "skip.onnx", (1, 3, 16, 16))))
    teacher.metadata_props.add(key="names", value="{0: 'cat'}")  # as ultralytics writes its class names
    x = np.random.default_rng(0).standard_normal((64, 3, 16, 16)).astype(np.float32)
    calib = ArraySet({"input": x}, np.arange(len(x)), {"input": np.dtype(np.float32)})
    options = options_from(Ratio(0.5), Local(), Epsilon(), NoRefit(), provider="cpu", round_to=1)
    return teacher, compress(teacher, calib, options)[0], x


def test_compress_writes_which_channels_each_narrowed_tensor_holds(skip) -> None:
    """The first narrowed conv's output (its input untouched) is the teacher's at the channels the map names; every
    narrowed tensor is in the map with the student's width; the exporter's metadata is kept beside it."""
    teacher, student, x = skip
    assert [p.key for p in student.metadata_props] == ["names", "onnxprune.kept"]
    kept = read_kept(student)
    s_graph, t_graph = import_graph(student), import_graph(teacher)
    s_shapes = {n: t.shape for n, t in s_graph.tensors().items()}
    t_shapes = {n: t.shape for n, t in t_graph.tensors().items()}
    narrowed = [n for n in s_shapes if n in t_shapes and s_shapes[n] and s_shapes[n][1:] != t_shapes[n][1:]]
    assert narrowed and set(narrowed) <= set(kept)
    assert all(len(kept[n][1]) == s_shapes[n][kept[n][0]] for n in narrowed)
    first = next(n.outputs[0].name for n in s_graph.nodes
                 if n.op == "Conv" and n.outputs[0].name in kept and n.inputs[0].name not in kept)
    (s_out,), (t_out,) = (run_segment(g, {"input": x}, [first], provider="cpu", batch_size=64)[0].values()
                          for g in (s_graph, t_graph))
    assert s_out.shape[1] < t_out.shape[1]
    np.testing.assert_allclose(s_out, t_out[:, kept[first][1]], rtol=1e-5, atol=1e-5)


def test_a_recovered_model_keeps_the_metadata(skip) -> None:
    """The exporter's metadata and the map of kept channels reach the written model (graph-surgeon drops them)."""
    teacher, student, x = skip
    calib = ArraySet({"input": x}, np.arange(len(x)), {"input": np.dtype(np.float32)})
    model, report = recover(student, teacher, calib, RecoverOptions(steps=100, batch_size=16, provider="cpu",
                                                                    method="block"))
    assert report.improved and model is not student
    assert model.metadata_props == student.metadata_props


def test_a_model_pruned_twice_names_the_first_original_channels(skip) -> None:
    """compress on a pruned model composes the map: every tensor keeps a subset of what it held, in the first
    original's indices (a tensor not narrowed again keeps its entry)."""
    _, student, x = skip
    calib = ArraySet({"input": x}, np.arange(len(x)), {"input": np.dtype(np.float32)})
    options = options_from(Ratio(0.6), Local(), Epsilon(), NoRefit(), provider="cpu", round_to=1)
    once, twice = read_kept(student), read_kept(compress(student, calib, options)[0])
    assert set(once) <= set(twice)
    assert any(len(twice[n][1]) < len(once[n][1]) for n in once)
    for name, (axis, index) in once.items():
        assert twice[name][0] == axis and set(twice[name][1]) <= set(index)
