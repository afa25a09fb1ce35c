"""Timing fidelity: record a real executor's iterations, calibrate the cost model to them, and
replay the same requests in the simulator (``tailserve calibrate --executor torch``,
``benchmarks/fidelity_cpu.py``, docs/fidelity.md)."""
