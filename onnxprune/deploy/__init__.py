"""Deployment: onnxruntime latency benchmarks (``onnxprune.deploy.bench``) and TensorRT export
(``onnxprune.deploy.export``; TensorRT itself is optional and imported only when building/timing engines).

Import from the submodules (``from onnxprune.deploy.bench import bench``): re-exporting ``bench`` here
would shadow the ``bench`` submodule.
"""
