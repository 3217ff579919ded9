"""What a budget buys: the MAC and latency costs of a model's widths (``cost``), and widths within a budget
(``allocation``), which the allocators' strategies and the pruning loop read."""
