"""Plain-torch model zoo (torchvision layouts, no torchvision) and its ONNX exporter."""

from models.build import MODEL_NAMES, build, export_model, export_onnx

__all__ = ["MODEL_NAMES", "build", "export_model", "export_onnx"]
