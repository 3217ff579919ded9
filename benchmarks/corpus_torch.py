"""Exports of the third-party corpus made through ``torch.onnx.export``: architectures written in code
(``models/corpus.py`` and the zoo; random weights: they test structure, time and memory) in the export styles
users meet: static batch and dynamic, opsets 9 to 20, BatchNorm left unfolded (``do_constant_folding=False``),
the TorchScript path and the dynamo path (where onnxscript is installed; else those rows are skipped, said so),
float16 inside (onnxconverter-common). Their BatchNorm statistics are warmed on photos the corpus table neither
calibrates nor judges on (``--warm-subset`` of ``--data``: the running mean and variance each channel sees there, as
a trained network has).

    python benchmarks/corpus_torch.py      # writes benchmarks/results/third_party_models/made/
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corpus_args import selected  # noqa: E402
from models import corpus, corpus_former, corpus_recent  # noqa: E402
from models.build import build  # noqa: E402
from onnxprune.calib.sources import load_calibration, preprocess_for  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet-sample-dev"

# file name -> (builder, input shape, export keyword arguments; "dynamic": the batch dim named, "folding": False
# keeps BatchNorm unfolded, "dynamo": the torch.export path, "fp16": converted to float16 inside by
# onnxconverter-common, float32 input and output)
EXPORTS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...], dict]] = {
    "pt_u2net_like_320_static_op11.onnx": (corpus.SkipSizedUNet, (1, 3, 320, 320), dict(opset=11)),
    "pt_unet_skip_sized_256_dynamic_op17.onnx": (corpus.SkipSizedUNet, (1, 3, 256, 256), dict(opset=17, dynamic=True)),
    "pt_keras_like_unet_nhwc_256_static_op13.onnx": (corpus.ChannelsLastUNet, (1, 256, 256, 3), dict(opset=13)),
    "pt_centerface_like_480x640_bn_op9.onnx": (corpus.CenterFaceLike, (1, 3, 480, 640), dict(opset=9, folding=False)),
    "pt_nms_free_320_static_op17.onnx": (corpus.NmsFreeDetector, (1, 3, 320, 320), dict(opset=17)),
    "pt_scrfd_like_640_dynamic_op12.onnx": (corpus.DenseFaceHead, (1, 3, 640, 640), dict(opset=12, dynamic=True)),
    "pt_crnn_bilstm_32x128_dynamic_op14.onnx": (corpus.CRNN, (1, 1, 32, 128), dict(opset=14, dynamic=True)),
    "pt_resnet34_224_dynamic_op20.onnx": (lambda: build("resnet34"), (1, 3, 224, 224), dict(opset=20, dynamic=True)),
    "pt_mobilenet_v3_small_224_bn_op13.onnx": (lambda: build("mobilenet_v3_small"), (1, 3, 224, 224),
                                               dict(opset=13, folding=False)),
    "pt_vgg11_224_static_op11.onnx": (lambda: build("vgg11"), (1, 3, 224, 224), dict(opset=11)),
    "pt_resnet50_224_dynamo_op18.onnx": (lambda: build("resnet50"), (1, 3, 224, 224), dict(opset=18, dynamo=True)),
    "pt_u2net_like_320_dynamo_op18.onnx": (corpus.SkipSizedUNet, (1, 3, 320, 320), dict(opset=18, dynamo=True)),
    "pt_convnext_like_224_dynamic_op17.onnx": (corpus.ConvNeXtLike, (1, 3, 224, 224), dict(opset=17, dynamic=True)),
    "pt_shufflenet_like_224_static_op13.onnx": (corpus.ShuffleNetLike, (1, 3, 224, 224), dict(opset=13)),
    "pt_ghostnet_like_224_static_op13.onnx": (corpus.GhostNetLike, (1, 3, 224, 224), dict(opset=13)),
    "pt_densenet_like_224_dynamic_op15.onnx": (corpus.DenseNetLike, (1, 3, 224, 224), dict(opset=15, dynamic=True)),
    "pt_regnet_like_224_static_op12.onnx": (corpus.RegNetLike, (1, 3, 224, 224), dict(opset=12)),
    "pt_mobilevit_like_256_dynamic_op13.onnx": (corpus.MobileViTLike, (1, 3, 256, 256), dict(opset=13, dynamic=True)),
    "pt_inception_like_224_dynamo_op18.onnx": (corpus.InceptionLike, (1, 3, 224, 224), dict(opset=18, dynamo=True)),
    "pt_shufflenet_like_224_dynamic_op17.onnx": (corpus.ShuffleNetLike, (1, 3, 224, 224), dict(opset=17, dynamic=True)),
    "pt_shufflenet_like_224_dynamo_op18.onnx": (corpus.ShuffleNetLike, (1, 3, 224, 224), dict(opset=18, dynamo=True)),
    "pt_vovnet_like_224_dynamic_op13.onnx": (corpus.VoVNetLike, (1, 3, 224, 224), dict(opset=13, dynamic=True)),
    "pt_vovnet_like_224_static_op17.onnx": (corpus.VoVNetLike, (1, 3, 224, 224), dict(opset=17)),
    "pt_vovnet_like_224_dynamo_op18.onnx": (corpus.VoVNetLike, (1, 3, 224, 224), dict(opset=18, dynamo=True)),
    "pt_repvgg_like_224_static_op17.onnx": (corpus.RepVGGLike, (1, 3, 224, 224), dict(opset=17)),
    "pt_repvgg_like_224_dynamic_op13.onnx": (corpus.RepVGGLike, (1, 3, 224, 224), dict(opset=13, dynamic=True)),
    "pt_repvgg_like_224_dynamo_op18.onnx": (corpus.RepVGGLike, (1, 3, 224, 224), dict(opset=18, dynamo=True)),
    "pt_mobilenet_v3_small_224_fp16_op13.onnx": (lambda: build("mobilenet_v3_small"), (1, 3, 224, 224),
                                                 dict(opset=13, fp16=True)),
    "pt_resnext_like_224_dynamic_op13.onnx": (corpus_recent.ResNeXtLike, (1, 3, 224, 224),
                                              dict(opset=13, dynamic=True)),
    "pt_cspresnet_like_224_static_op17.onnx": (corpus_recent.CSPResNetLike, (1, 3, 224, 224), dict(opset=17)),
    "pt_efficientvit_like_224_static_op17.onnx": (corpus_recent.EfficientViTLike, (1, 3, 224, 224), dict(opset=17)),
    "pt_efficientvit_like_224_dynamic_op13.onnx": (corpus_recent.EfficientViTLike, (1, 3, 224, 224),
                                                   dict(opset=13, dynamic=True)),
    "pt_efficientvit_like_224_dynamo_op18.onnx": (corpus_recent.EfficientViTLike, (1, 3, 224, 224),
                                                  dict(opset=18, dynamo=True)),
    "pt_edgenext_like_256_static_op17.onnx": (corpus_recent.EdgeNeXtLike, (1, 3, 256, 256), dict(opset=17)),
    "pt_edgenext_like_256_dynamic_op13.onnx": (corpus_recent.EdgeNeXtLike, (1, 3, 256, 256),
                                               dict(opset=13, dynamic=True)),
    "pt_edgenext_like_256_dynamo_op18.onnx": (corpus_recent.EdgeNeXtLike, (1, 3, 256, 256),
                                              dict(opset=18, dynamo=True)),
    "pt_fastvit_like_256_static_op17.onnx": (corpus_recent.FastViTLike, (1, 3, 256, 256), dict(opset=17)),
    "pt_fastvit_like_256_dynamic_op13.onnx": (corpus_recent.FastViTLike, (1, 3, 256, 256),
                                              dict(opset=13, dynamic=True)),
    "pt_fastvit_like_256_dynamo_op18.onnx": (corpus_recent.FastViTLike, (1, 3, 256, 256), dict(opset=18, dynamo=True)),
    "pt_efficientformerv2_like_224_static_op17.onnx": (corpus_former.EfficientFormerV2Like, (1, 3, 224, 224),
                                                       dict(opset=17)),
    "pt_efficientformerv2_like_224_dynamic_op13.onnx": (corpus_former.EfficientFormerV2Like, (1, 3, 224, 224),
                                                        dict(opset=13, dynamic=True)),
    "pt_efficientformerv2_like_224_dynamo_op18.onnx": (corpus_former.EfficientFormerV2Like, (1, 3, 224, 224),
                                                       dict(opset=18, dynamo=True)),
}


def export(module: torch.nn.Module, shape: tuple[int, ...], path: Path, opset: int, dynamic: bool = False,
           folding: bool = True, dynamo: bool = False, fp16: bool = False) -> None:
    x = torch.randn(*shape)
    outputs = module(x)
    names = [f"output{i}" for i in range(len(outputs) if isinstance(outputs, tuple) else 1)]
    axes = {name: {0: "batch"} for name in ["input", *names]} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=dynamo, opset_version=opset, input_names=["input"],
                          output_names=names, dynamic_axes=None if dynamo else axes, do_constant_folding=folding)
    if fp16:
        from onnxconverter_common import float16  # a test dependency (pyproject's ``test`` extra)

        onnx.save(float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True), str(path))


def warm_batchnorms(module: torch.nn.Module, shape: tuple[int, ...], data: Path, subset: str) -> None:
    """Set every BatchNorm's running statistics to the average of its batch statistics over the photos ``subset``
    of ``data``, preprocessed as ``compress`` does for this input (the rest of the module stays in eval mode)."""
    spec = [("input", list(shape), np.dtype(np.float32))]
    samples = load_calibration(data, spec, preprocess=preprocess_for(spec), subset=subset)
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches
        m.train()
    with torch.no_grad():
        for batch in samples.batches(25):
            module(torch.from_numpy(batch["input"]))
    for m in norms:
        m.eval()


def main() -> None:
    out, names, args = selected(__doc__, EXPORTS, extra=lambda parser: (
        parser.add_argument("--data", type=Path, default=DATA, help="photos to warm BatchNorm statistics on"),
        parser.add_argument("--warm-subset", default="400:500", help="which photos (third_party.py calibrates on "
                            "0:64 and judges on 100:150)")))
    for name in names:
        make, shape, kwargs = EXPORTS[name]
        if kwargs.get("dynamo") and importlib.util.find_spec("onnxscript") is None:
            print(f"{name}: skipped, the dynamo exporter needs onnxscript (pip install onnxscript)")
            continue
        torch.manual_seed(0)
        module = make().eval()
        warm_batchnorms(module, shape, args.data, args.warm_subset)
        export(module, shape, out / name, **kwargs)
        print(out / name)


if __name__ == "__main__":
    main()
