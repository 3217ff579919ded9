"""The floor between the pruning loop (``onnxprune.pipeline``) and its strategies (``onnxprune.strategies``).

``context`` is what a strategy may read and do of a run (the ``Context`` protocol, which the loop's
``Compressor`` implements) and the consumers' statistics it is handed; ``statistics`` streams those
statistics and the local-imitation error curves; ``reconstruct`` writes consumers' weights into a graph
(the least-squares refit, the per-channel scale). Strategies and the loop both stand on this floor; it
imports neither.
"""
