"""How torch's OpenMP threads wait (threads.set_openmp_wait_policy): a bounded spin unless the
user chose a wait setting, read when torch loads and not left behind for child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, os
import tailserve.executors.pytorch as p
print(json.dumps({"said": p.OPENMP_WAIT, "left": {v: os.environ.get(v) for v in
                  ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}}))
"""


def _probe(**env: str) -> dict:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_loads_with_the_bounded_spin_and_the_variable_is_removed_after() -> None:
    from tailserve.executors.pytorch.threads import SPIN_COUNT

    got = _probe()
    assert got["said"] == f"OpenMP wait: spin {SPIN_COUNT:,}, then sleep"
    assert got["left"] == {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None}


def test_a_wait_setting_the_user_chose_is_kept() -> None:
    got = _probe(OMP_WAIT_POLICY="PASSIVE")
    assert got["said"] == "OpenMP wait as set (OMP_WAIT_POLICY=PASSIVE)"
    assert got["left"]["OMP_WAIT_POLICY"] == "PASSIVE"
