"""The model's normal form: what it becomes on the way in (``load``), on the way out (``written``) and before training
(``untied``), and the graph-surgeon passes that make it, one per module (``Graph -> Graph``). The pruning's own
surgery on that form (slicing channels, refits, removed blocks) is ``onnxprune.passes``."""

from onnxprune.normal.form import LOAD_REWRITES, UNTIE, WRITE_REWRITES, load, untied, written

__all__ = ["LOAD_REWRITES", "UNTIE", "WRITE_REWRITES", "load", "untied", "written"]
