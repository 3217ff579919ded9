"""Graph analysis: channel groups, MAC/parameter counts."""

from onnxprune.analysis.model import Analysis, analyze

__all__ = ["Analysis", "analyze"]
