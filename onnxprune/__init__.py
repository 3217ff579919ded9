"""onnxprune: channel pruning of ONNX CNNs by greedy local imitation."""

__version__ = "0.1.0"
