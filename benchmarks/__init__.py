"""tailserve's benchmarks, run as ``python -m benchmarks.NAME`` from the repository root
(docs/benchmarks.md lists them); helpers shared by all are in ``benchmarks._common``."""
