"""``tailserve tune`` ranks ``slo`` beside the engines, scheduled against the SLO being tuned for."""

from __future__ import annotations

import contextlib
import io
import json

from tailserve.cli import main
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.policies.registry import PolicySpec
from tailserve.tune.capacity import parse_capacity_slo
from tailserve.tune.recommend import DEFAULT_TUNE_POLICIES, command_line, with_slo_targets


def test_slo_gets_the_tuned_slo_as_its_class():
    slo = parse_capacity_slo("ttft_p99=1s,tbt_p99=50ms")
    spec = with_slo_targets(PolicySpec.make("slo", {}), slo)
    assert spec.flags["slo_classes"] == "tuned=ttft:1000ms,tbt:50ms"
    given = PolicySpec.make("slo", {"slo_classes": "x=ttft:2s,tbt:1s"})
    assert with_slo_targets(given, slo) is given
    vllm = PolicySpec.make("vllm", {})
    assert with_slo_targets(vllm, slo) is vllm
    assert "slo" in DEFAULT_TUNE_POLICIES.split(",")
    assert "trtllm" in DEFAULT_TUNE_POLICIES.split(",")  # 2026's engines: TensorRT-LLM's flags too
    device = get_hardware("H100-SXM").device_info
    line = command_line(spec, Deployment.of("Llama-3-8B", "H100-SXM", 1), None, device, 8192)
    assert line == "tailserve serve --model MODEL_DIR --policy slo --slo-classes 'tuned=ttft:1000ms,tbt:50ms'"


def test_tune_ranks_slo_with_the_engines(tmp_path):
    out = tmp_path / "tune.json"
    args = [
        "tune", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--workload", "random",
        "--num-requests", "80", "--input-len", "lognormal:mean=1500,sigma=1,max=7000", "--output-len", "64",
        "--rate", "8", "--slo", "ttft_p99=1s,tbt_p99=50ms", "--chunk-sizes", "512,2048",
        "--workers", "1", "--quiet", "--policies", "vllm,slo", "--json", str(out), "--out", str(tmp_path / "r.jsonl"),
    ]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(args) == 0
    ranked = json.loads(out.read_text())["policies"]
    by_name = {p["policy"].split(":")[0]: p for p in ranked}
    assert set(by_name) == {"vllm", "slo"} and by_name["slo"]["capacity_req_s"] > 0
    assert by_name["slo"]["command"].startswith("tailserve serve --model MODEL_DIR --policy slo")
    capacities = [p["capacity_req_s"] for p in ranked]
    assert capacities == sorted(capacities, reverse=True)
