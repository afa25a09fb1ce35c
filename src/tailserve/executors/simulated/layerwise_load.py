"""A forward pass that waits, layer by layer, for KV loaded from host memory (SGLang's HiCache).

SGLang starts a prefill batch's host->device loads on their own stream as the batch launches
(``ready_to_load_host_cache`` -> ``HiCacheController.start_loading``,
``managers/scheduler.py:4351-4355``, ``managers/cache_controller.py:1028-1069@v0.5.23``), one
layer after another, and the forward's attention of layer ``i`` waits until layer ``i`` is in
(``LayerDoneCounter.wait_until``, ``mem_cache/memory_pool.py:1674-1683@v0.5.23``). With the copy
and the compute each split evenly over ``L`` layers (``load / L`` and ``forward / L`` each), the
pipeline ends at ``max(load + forward / L, forward + load / L)``: the slower of the two streams
plus one layer of the faster one.
"""

from __future__ import annotations


def layerwise_load_time(forward: float, load: float, num_layers: int) -> float:
    """The step's time when its forward pass overlaps a ``load`` seconds layer-wise copy."""
    if load <= 0.0:
        return forward
    layers = max(num_layers, 1)
    return max(load + forward / layers, forward + load / layers)
