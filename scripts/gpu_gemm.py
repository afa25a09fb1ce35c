"""GEMM times on the CUDA GPU at hand, from a checkout with no install (a GPU machine without a
package registry): ``python3 scripts/gpu_gemm.py --out gemm.json [--dense]``. The sweep is
``tailserve.fidelity.gpu_gemm`` (``tailserve calibrate --time-gemms FILE`` where tailserve is
installed); ``--calibration gemm:gemm.json`` prices a deployment with the curves fitted to it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from tailserve.fidelity.gpu_gemm import main

if __name__ == "__main__":
    raise SystemExit(main())
