"""The road to and from PyTorch: a model (pruned or not) as a trainable ``nn.Module`` and its trained weights
written back into the same graph (``bridge``)."""

from onnxprune.torch.bridge import from_torch, to_torch

__all__ = ["from_torch", "to_torch"]
