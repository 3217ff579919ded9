"""The road to and from PyTorch: a model (pruned or not) as a trainable ``nn.Module`` and its trained weights
written back into the same graph (``bridge``); the pruning applied to the user's own module (``manifest``)."""

from onnxprune.torch.bridge import from_torch, to_torch
from onnxprune.torch.manifest import apply_manifest, load_manifest, save_manifest

__all__ = ["apply_manifest", "from_torch", "load_manifest", "save_manifest", "to_torch"]
