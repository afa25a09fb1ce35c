"""``simulate --save-run`` writes compact JSON piece by piece (``cli/base.py``'s ``_write_compact``):
the text is exactly ``json.dumps(payload, separators=(",", ":"))``, and a saved run loads back
equal to the run it was written from."""

from __future__ import annotations

import json
import math

from tailserve.cli import main
from tailserve.cli.base import write_json
from tailserve.sim.run_file import load_run


def test_the_pieces_are_the_one_shot_text(tmp_path):
    payload = {
        "a": list(range(3000)),  # long lists at both walked levels, chunked
        "b": {"times": [i / 7 for i in range(2500)], "nested": {"x": [1.5, None, "s"]}, "e": []},
        "c": {1: "int keys", 2.5: "float keys"},  # encoded whole: json's own key conversion
        "d": [{"k": [math.inf, -0.0]}] * 1500,
        "unicode": "é\u2028",
    }
    path = tmp_path / "x.json"
    write_json(str(path), payload, indent=None)
    assert path.read_text() == json.dumps(payload, separators=(",", ":")) + "\n"


def test_a_saved_run_loads_back(tmp_path):
    path = tmp_path / "run.json"
    assert main(["simulate", "--workload", "hol", "--save-run", str(path)]) == 0
    text = path.read_text()
    assert "\n" not in text.rstrip("\n")  # compact
    run = load_run(path)
    assert run.batches is not None and len(run.requests) == 11
    assert json.loads(text)["requests"] == json.loads(json.dumps(run.to_json()))["requests"]
