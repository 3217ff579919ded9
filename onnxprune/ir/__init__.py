"""The ground floor: an ONNX model as the rest of the package reads it.

``load`` reads and normalises a file into a graph-surgeon graph, ``shapes`` fills the shapes an export
leaves unknown (ONNX inference, onnxruntime runs at batch 1 and 2, shape-only values folded), ``inputs``
reads and writes input shapes, ``ort`` makes onnxruntime sessions, ``probe`` runs a model to read its
tensors and its batch, ``graph`` and ``subgraphs`` are the graph helpers every floor above uses. Nothing
here imports another ``onnxprune`` package except ``errors``.
"""
