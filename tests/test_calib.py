"""Image preprocessing, subsets and calibration sources."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader
from PIL import Image

from onnxprune.calib.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess, label_from_name, list_images, select
from onnxprune.calib.sources import ArraySet, load_calibration, load_image_folder
from onnxprune.errors import CalibrationError

SPECS = [("x", ["batch", 3, 32, 32], np.dtype(np.float32))]
RAW = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0), "scale": 1.0}  # Preprocess kwargs giving raw pixels


def write_image(path: Path, size: tuple[int, int] = (40, 36), color: tuple[int, int, int] = (255, 0, 0)) -> Path:
    """A solid-colour RGB image of ``size`` (width, height) at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def image_folder(root: Path, n: int) -> Path:
    """A folder of ``n`` labelled images with different colours."""
    for i in range(n):
        write_image(root / f"{i:03d}_n0000_cat.png", color=(20 * i, 100, 255 - 20 * i))
    return root


# --- preprocessing -------------------------------------------------------------------------------


def test_preprocess_shapes_and_layouts(tmp_path: Path) -> None:
    img = write_image(tmp_path / "a.jpg", size=(64, 48))
    assert Preprocess(resize=32, crop=24)(img).shape == (3, 24, 24)
    assert Preprocess(resize=32, crop=24, layout="nhwc")(img).shape == (24, 24, 3)
    assert Preprocess(resize=32, crop=(20, 30))(img).shape == (3, 20, 30)
    assert Preprocess(resize=32, crop=None)(img).shape == (3, 32, 43)  # short side 48 -> 32, 64 -> 43
    assert Preprocess(resize=None, crop=None)(img).shape == (3, 48, 64)
    # The short side never ends up below the crop, so a small image still gives the crop size.
    assert Preprocess(resize=16, crop=24)(write_image(tmp_path / "small.png", size=(10, 12))).shape == (3, 24, 24)
    x = Preprocess()(img)
    assert x.dtype == np.float32 and x.shape == (3, 224, 224) and x.flags["C_CONTIGUOUS"]


def test_preprocess_normalisation_and_bgr(tmp_path: Path) -> None:
    img = write_image(tmp_path / "red.png", color=(255, 0, 0))
    expected = (np.array([1.0, 0.0, 0.0]) - IMAGENET_MEAN) / IMAGENET_STD
    x = Preprocess(resize=32, crop=32)(img)
    np.testing.assert_allclose(x.reshape(3, -1), np.repeat(expected[:, None], 32 * 32, axis=1), rtol=1e-5)
    bgr = Preprocess(resize=32, crop=32, bgr=True)(img)
    np.testing.assert_allclose(bgr, x[::-1], rtol=1e-6)
    raw = Preprocess(resize=None, crop=None, layout="nhwc", **RAW)(img)
    np.testing.assert_array_equal(raw[0, 0], [255.0, 0.0, 0.0])


def test_preprocess_flip_mirrors(tmp_path: Path) -> None:
    path = tmp_path / "half.png"
    pixels = np.zeros((8, 10, 3), np.uint8)
    pixels[:, :3] = (255, 0, 0)
    Image.fromarray(pixels).save(path)
    pre = Preprocess(resize=None, crop=None, **RAW)
    x, mirrored = pre(path), pre(path, flip=True)
    np.testing.assert_array_equal(mirrored, x[:, :, ::-1])
    assert x[0, 0, 0] == 255 and mirrored[0, 0, -1] == 255


def test_preprocess_rejects_bad_settings() -> None:
    with pytest.raises(CalibrationError, match="layout"):
        Preprocess(layout="chw")  # type: ignore[arg-type]
    with pytest.raises(CalibrationError, match="3 values"):
        Preprocess(mean=(0.5,))


# --- labels, listing, subsets --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "label"),
    [("042_n01687978_agama.jpg", 42), ("d/7.png", 7), ("0_x.jpg", 0), ("n01687978_agama.jpg", None), ("a1.jpg", None)],
)
def test_label_from_name(name: str, label: int | None) -> None:
    assert label_from_name(name) == label


def test_list_images_recursive_sorted_case_insensitive(tmp_path: Path) -> None:
    for rel in ("b/2.JPG", "a.png", "c.Jpeg", "b/1.bmp", "d.webp"):
        write_image(tmp_path / rel)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "dir.jpg").mkdir()
    names = [p.relative_to(tmp_path).as_posix() for p in list_images(tmp_path)]
    assert names == ["a.png", "b/1.bmp", "b/2.JPG", "c.Jpeg", "d.webp"]


def test_list_images_errors(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="no images in"):
        list_images(tmp_path)
    with pytest.raises(CalibrationError, match="not found"):
        list_images(tmp_path / "missing")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, list(range(10))),
        ("0:4", [0, 1, 2, 3]),
        ("::3", [0, 3, 6, 9]),
        ("-2:", [8, 9]),
        ("1::4", [1, 5, 9]),
        ("2%5", [2, 7]),
        ("!2%5", [0, 1, 3, 4, 5, 6, 8, 9]),
        ("1,3%5", [1, 3, 6, 8]),
        ("!0,1%5", [2, 3, 4, 7, 8, 9]),
        ("!2:8", [0, 1, 8, 9]),
        ("!::3", [1, 2, 4, 5, 7, 8]),
        ("!0:4&!1%5", [4, 5, 7, 8, 9]),
        ("2:9&0,1%2&!3%5", [2, 4, 5, 6, 7]),
        ("8:&::-1", [8, 9]),
    ],
)
def test_select(spec: str | None, expected: list[int]) -> None:
    assert select(list(range(10)), spec) == expected


def test_a_class_range_split_partitions_the_items_into_train_held_and_test() -> None:
    items = list(range(500))
    test = select(items, "125:250")
    train, held = select(items, "!125:250&!1%5"), select(items, "!125:250&1%5")
    assert sorted(test + train + held) == items and len(held) == 75 and len(train) == 300
    assert max(train + held) > 250 and not set(train + held) & set(range(125, 250))


def test_select_complement_partitions() -> None:
    items = [f"img{i}" for i in range(23)]
    for n in (2, 3, 7):
        for k in range(n):
            calib, held_out = select(items, f"{k}%{n}"), select(items, f"!{k}%{n}")
            assert sorted(calib + held_out) == sorted(items) and not set(calib) & set(held_out)


@pytest.mark.parametrize("spec", ["abc", "1:2:3:4", "::0", "0%0", "3%2", "%2", "1.5:3", "5:5", "1,%5", "0,5%5", "!:",
                                  "0:5&5:", "0:5&", "&1%2", "0:5&!!1%2"])
def test_select_bad_spec(spec: str) -> None:
    with pytest.raises(CalibrationError, match="accepted forms|selects none"):
        select(list(range(10)), spec)


# --- image folder source -------------------------------------------------------------------------


def test_image_folder_batches_streamed(tmp_path: Path) -> None:
    calls: list[Path] = []

    class Counting(Preprocess):
        def __call__(self, path: str | Path, *, flip: bool = False) -> np.ndarray:
            calls.append(Path(path))
            return super().__call__(path, flip=flip)

    data = load_calibration(image_folder(tmp_path, 10), SPECS, preprocess=Counting(resize=32, crop=None))
    assert len(data) == 10 and data.input_names == ["x"]
    batches = data.batches(4)
    first = next(batches)
    assert first["x"].shape == (4, 3, 32, 32) and first["x"].dtype == np.float32
    assert len(calls) == 1 + 4  # the up-front fit check, then one batch only
    assert [b["x"].shape[0] for b in batches] == [4, 2]
    assert [b["x"].shape[0] for b in data.batches(4)] == [4, 4, 2]  # re-iterable


def test_image_folder_crop_none_uses_model_dims_and_nhwc(tmp_path: Path) -> None:
    folder = image_folder(tmp_path, 3)
    data = load_calibration(folder, SPECS, preprocess=Preprocess(crop=None))
    assert next(data.batches(8))["x"].shape == (3, 3, 32, 32)
    nhwc = [("img", [1, 20, 24, 3], np.dtype(np.float32))]
    data = load_calibration(folder, nhwc, preprocess=Preprocess(crop=None, layout="nhwc"))
    assert next(data.batches(8))["img"].shape == (3, 20, 24, 3)


def test_image_folder_subset_limit_flip(tmp_path: Path) -> None:
    folder = image_folder(tmp_path, 10)
    pre = Preprocess(crop=None)
    assert len(load_calibration(folder, SPECS, preprocess=pre, subset="0%2")) == 5
    assert len(load_calibration(folder, SPECS, preprocess=pre, subset="!0%2", limit=3)) == 3
    flipped = load_calibration(folder, SPECS, preprocess=pre, limit=3, flip=True)
    assert len(flipped) == 6
    x = np.concatenate([b["x"] for b in flipped.batches(4)])
    np.testing.assert_allclose(x[1], x[0][:, :, ::-1])
    np.testing.assert_allclose(x[5], x[4][:, :, ::-1])


def test_image_folder_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CalibrationError, match="no images"):
        load_calibration(empty, SPECS)
    folder = image_folder(tmp_path / "imgs", 3)
    (folder / "002_broken.jpg").write_bytes(b"definitely not a jpeg")
    with pytest.raises(CalibrationError, match="002_broken.jpg"):
        load_calibration(folder, SPECS, preprocess=Preprocess(crop=None))
    good = image_folder(tmp_path / "good", 2)
    with pytest.raises(CalibrationError, match=r"'x' expects \[3, 32, 32\].*set the crop"):
        load_calibration(good, SPECS)  # default crop 224 vs a 32x32 input
    with pytest.raises(CalibrationError, match="layout"):
        load_calibration(good, SPECS, preprocess=Preprocess(crop=32, layout="nhwc"))
    two_inputs = SPECS + [("y", ["batch", 4], np.dtype(np.float32))]
    with pytest.raises(CalibrationError, match="x, y"):
        load_calibration(good, two_inputs)
    with pytest.raises(CalibrationError, match="not found"):
        load_calibration(tmp_path / "nowhere", SPECS)
    with pytest.raises(CalibrationError, match="accepted forms"):
        load_calibration(good, SPECS, preprocess=Preprocess(crop=None), subset="half")
    with pytest.raises(CalibrationError, match="limit must be positive"):
        load_calibration(good, SPECS, limit=0)


# --- array and Python sources --------------------------------------------------------------------


def test_npy_source(tmp_path: Path) -> None:
    path = tmp_path / "calib.npy"
    arr = np.random.default_rng(0).normal(size=(7, 3, 32, 32))  # float64 is cast to the input dtype
    np.save(path, arr)
    data = load_calibration(str(path), SPECS, subset="1:", limit=5)
    batches = list(data.batches(2))
    assert len(data) == 5 and [b["x"].shape[0] for b in batches] == [2, 2, 1]
    assert batches[0]["x"].dtype == np.float32
    np.testing.assert_allclose(np.concatenate([b["x"] for b in batches]), arr[1:6], rtol=1e-6)
    np.save(tmp_path / "wrong.npy", np.zeros((2, 3, 16, 16), np.float32))
    with pytest.raises(CalibrationError, match=r"'x' expects \(samples, 3, 32, 32\)"):
        load_calibration(tmp_path / "wrong.npy", SPECS)
    with pytest.raises(CalibrationError, match="is int64 but the data is float64"):
        load_calibration(path, [("x", ["batch", 3, 32, 32], np.dtype(np.int64))])
    with pytest.raises(CalibrationError, match="missing.npy not found"):
        load_calibration(tmp_path / "missing.npy", SPECS)
    with pytest.raises(CalibrationError, match="flip"):
        load_calibration(path, SPECS, flip=True)


def test_npz_source(tmp_path: Path) -> None:
    specs = SPECS + [("meta", [None, 4], np.dtype(np.float32))]
    path = tmp_path / "calib.npz"
    np.savez(path, x=np.ones((6, 3, 32, 32), np.float32), meta=np.arange(24, dtype=np.float32).reshape(6, 4))
    data = load_calibration(path, specs, subset="!0%3")
    assert len(data) == 4 and data.input_names == ["x", "meta"]
    batch = next(data.batches(10))
    np.testing.assert_array_equal(batch["meta"][:, 0], [4, 8, 16, 20])
    np.savez(tmp_path / "partial.npz", x=np.ones((2, 3, 32, 32), np.float32))
    with pytest.raises(CalibrationError, match="lacks input.*meta.*provide arrays named x, meta"):
        load_calibration(tmp_path / "partial.npz", specs)
    np.savez(tmp_path / "uneven.npz", x=np.ones((2, 3, 32, 32), np.float32), meta=np.ones((3, 4), np.float32))
    with pytest.raises(CalibrationError, match="different sample counts"):
        load_calibration(tmp_path / "uneven.npz", specs)


def test_callable_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "my_calib.py"
    script.write_text(
        "import itertools\n"
        "import numpy as np\n"
        "def samples():\n"
        "    yield np.zeros((3, 32, 32))\n"  # one sample
        "    yield np.ones((2, 3, 32, 32))\n"  # a batch
        "def forever():\n"
        "    return ({'x': np.full((3, 32, 32), i, np.float32)} for i in itertools.count())\n"
        "def wrong():\n"
        "    return [np.zeros((3, 32, 32)), np.zeros((3, 16, 16))]\n"
    )
    data = load_calibration(f"{script}:samples", SPECS)
    assert len(data) == 3
    np.testing.assert_array_equal(next(data.batches(8))["x"][:, 0, 0, 0], [0, 1, 1])
    monkeypatch.syspath_prepend(str(tmp_path))
    data = load_calibration("my_calib:forever", SPECS, limit=4)  # stops consuming at the limit
    np.testing.assert_array_equal(np.concatenate([b["x"][:, 0, 0, 0] for b in data.batches(3)]), [0, 1, 2, 3])
    with pytest.raises(CalibrationError, match=r"my_calib.py:wrong: input 'x' expects \(samples, 3, 32, 32\)"):
        len(load_calibration(f"{script}:wrong", SPECS))
    with pytest.raises(CalibrationError, match="no function 'nope'"):
        load_calibration(f"{script}:nope", SPECS)
    with pytest.raises(CalibrationError, match="cannot import no_such_module_xyz"):
        load_calibration("no_such_module_xyz:fn", SPECS)
    with pytest.raises(CalibrationError, match="missing.py not found"):
        load_calibration(f"{tmp_path / 'missing.py'}:fn", SPECS)


def test_calibration_data_reader_source() -> None:
    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{"x": np.full((1, 3, 32, 32), i, np.float32)} for i in range(5)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    reader = Reader()
    data = load_calibration(reader, SPECS, subset="::2")
    assert len(data) == 3
    for _ in range(2):  # materialised once, then reused every pass
        np.testing.assert_array_equal(np.concatenate([b["x"][:, 0, 0, 0] for b in data.batches(2)]), [0, 2, 4])
    empty = Reader()
    empty.feeds = iter([])
    with pytest.raises(CalibrationError, match="yielded no samples"):
        len(load_calibration(empty, SPECS))
    with pytest.raises(CalibrationError, match="unsupported calibration source"):
        load_calibration(42, SPECS)


@pytest.mark.parametrize("flip", [False, True])
def test_a_set_takes_the_samples_it_is_given(tmp_path: Path, flip: bool) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(folder / f"{i:03d}_x.png")
    specs = [("x", ["N", 3, 8, 8], np.dtype(np.float32))]
    images = load_image_folder(folder, specs, preprocess=Preprocess(resize=8, crop=8), flip=flip)
    arrays = ArraySet({"x": rng.standard_normal((6, 3, 8, 8)).astype(np.float32)}, np.arange(1, 6),
                      {"x": np.dtype(np.float32)})
    for data in (images, arrays):
        whole = np.concatenate([b["x"] for b in data.batches(3)])
        taken = data.take([0, 2, 4])
        assert len(taken) == 3
        np.testing.assert_array_equal(np.concatenate([b["x"] for b in taken.batches(2)]), whole[[0, 2, 4]])


def _model(output_rank: int | None) -> onnx.ModelProto:
    """x [N, 3, 32, 32] → a 1x1 Conv, then (rank 2) global pooling and a flatten: a classifier's scores; rank
    None: the same classifier with its output's shape left out (shape inference finds it)."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"])]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 32, 32])
    if output_rank != 4:
        nodes += [helper.make_node("GlobalAveragePool", ["y"], ["p"]), helper.make_node("Flatten", ["p"], ["z"])]
        out = helper.make_tensor_value_info("z", TensorProto.FLOAT, None if output_rank is None else ["N", 4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 32, 32])
    return helper.make_model(helper.make_graph(nodes, "g", [x], [out], [w]))


@pytest.mark.parametrize("rank, mirrored", [(2, True), (None, True), (4, False)])
def test_a_classifier_calibrates_on_each_image_and_its_mirror_by_default(tmp_path: Path, rank, mirrored) -> None:
    """``flip=None`` adds the mirrors for a classifier (first output 2-D, declared or inferred), not for a dense
    output; an explicit flip wins either way, and samples in memory are never mirrored."""
    from onnxprune import api
    from onnxprune.calib.sources import mirrors_by_default

    model, folder = _model(rank), image_folder(tmp_path, 3)
    assert mirrors_by_default(model) is mirrored
    pre = Preprocess(crop=None)
    assert len(api.calibration(folder, model, pre, flip=None)) == (6 if mirrored else 3)
    assert len(api.calibration(folder, model, pre, flip=False)) == 3
    assert len(api.calibration(folder, model, pre, flip=True)) == 6
    arrays = np.zeros((3, 3, 32, 32), np.float32)
    assert len(api.calibration(arrays, model, pre, flip=None)) == 3
