"""``compress``: layer-wise channel pruning of an ONNX model on calibration data.

Groups are pruned in graph order (``schedule``). At each group's cut (just before its first consumer) the
calibration set has been pushed through the already-pruned prefix and, in lockstep, through the
original network (``compressor.Compressor``). The consumers' unfolded inputs (pruned prefix) and outputs
(original network) are reduced to streamed statistics, from which the selector chooses the channels and the
reconstruction the consumer weights. The budget, the allocator, the selector and the reconstruction are
the strategy objects of ``CompressOptions`` (``onnxprune.strategies``): the loop calls them, it never
compares a name.
"""

from __future__ import annotations

from onnxprune.budget.cost import LatencyReport
from onnxprune.pipeline.compressor import Compressor
from onnxprune.pipeline.report import CompressReport, LayerReport
from onnxprune.pipeline.run import compress
from onnxprune.pipeline.schedule import schedule

__all__ = ["CompressReport", "Compressor", "LatencyReport", "LayerReport", "compress", "schedule"]
