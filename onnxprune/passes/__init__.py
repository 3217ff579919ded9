"""Graph-surgeon passes, one per module, each ``Graph -> Graph`` ending in cleanup().toposort() (not into
Loop/If/Scan bodies, which the tool leaves as they are); each one's docstring says whether it modifies its input graph in place (returning the same graph)."""

from onnxprune.passes.flatten_channels_first import flatten_channels_first
from onnxprune.passes.fold_branches import fold_branches
from onnxprune.passes.fuse_layer_norm import fuse_layer_norm
from onnxprune.passes.refit_consumer import refit_consumer
from onnxprune.passes.remove_block import remove_block
from onnxprune.passes.scale_columns import scale_columns
from onnxprune.passes.slice_channels import slice_channels
from onnxprune.passes.split_qkv import split_qkv
from onnxprune.passes.untie_weights import untie_weights
from onnxprune.passes.write_layer_norm import write_layer_norm

__all__ = ["flatten_channels_first", "fold_branches", "fuse_layer_norm", "refit_consumer", "remove_block",
           "scale_columns", "slice_channels", "split_qkv", "untie_weights", "write_layer_norm"]
