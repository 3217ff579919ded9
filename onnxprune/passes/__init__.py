"""The pruning's surgery on a model in normal form (``onnxprune.normal``): graph-surgeon passes, one per module, each
``Graph -> Graph`` ending in cleanup().toposort() (not into Loop/If/Scan bodies, which the tool leaves as they are);
each one's docstring says whether it modifies its input graph in place (returning the same graph)."""

from onnxprune.passes.refit_consumer import refit_consumer
from onnxprune.passes.remove_block import remove_block
from onnxprune.passes.scale_columns import scale_columns
from onnxprune.passes.slice_channels import slice_channels

__all__ = ["refit_consumer", "remove_block", "scale_columns", "slice_channels"]
