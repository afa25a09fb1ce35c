"""Names are resolved once: every spelling the tool accepts behaves exactly like the catalog's own
(defaults such as the seed deployment's TP 4, calibration, labels, JSON), and bad ones are one
clear line."""

from __future__ import annotations

import pytest

from tailserve.cli import main
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import resolve_hardware_name
from tailserve.executors.simulated.models import resolve_model_name
from tailserve.policies.registry import PolicySpec, resolve_policy_name

SEED_SPELLINGS = [
    ["--model", "Llama-3-70B", "--hardware", "A100-80GB"],
    ["--model", "llama-3-70b", "--hardware", "a100-80gb"],
    ["--model", "LLAMA-3-70B", "--hardware", "A100"],
    ["--model", "meta-llama/Meta-Llama-3-70B-Instruct", "--hardware", "nvidia a100"],
]


def _json_bytes(tmp_path, argv: list[str], name: str) -> bytes:
    out = tmp_path / name
    assert main([*argv, "--json", str(out)]) == 0
    return out.read_bytes()


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("llama-3-70b", "Llama-3-70B"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "Llama-3-8B"),
        ("meta-llama/Meta-Llama-3-8B", "Llama-3-8B"),
        ("meta-llama/Llama-3.1-70B-Instruct", "Llama-3.1-70B"),
        ("meta-llama/Llama-2-7b-chat-hf", "Llama-2-7B"),
        ("mistralai/Mistral-7B-Instruct-v0.2", "Mistral-7B"),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
        ("tiiuae/falcon-180B", "Falcon-180B"),
    ],
)
def test_model_spellings_resolve_to_the_catalog_name(text, canonical):
    assert resolve_model_name(text) == canonical


@pytest.mark.parametrize("text", ["meta-llama/Llama-3.2-1B", "01-ai/Yi-34B-200K", "gpt-9", ""])
def test_models_not_in_the_catalog_are_not_guessed(text):
    # A 200K-context variant has other shapes than Yi-34B: no match is better than a wrong one.
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model_name(text)


def test_hardware_and_policy_spellings():
    assert resolve_hardware_name("a100") == resolve_hardware_name("A100-80GB") == "A100-80GB"
    assert resolve_hardware_name("nvidia h100") == "H100-SXM"
    assert resolve_policy_name("VLLM") == "vllm" and resolve_policy_name("vLLM_V0") == "vllm-v0"
    assert PolicySpec.make("SGLang", {}).name == "sglang" and PolicySpec("TGI").name == "tgi"


def test_seed_tp_default_follows_the_resolved_names():
    assert Deployment.of("llama-3-70b", "a100").tp == 4
    assert Deployment.of("Llama-3-70B", "A100-80GB").tp == 4
    assert Deployment.of("Llama-3-70B", "H100").tp == 1
    assert Deployment.of("llama-3-70b", "A100-80GB", calibration="SEED").calibration == "seed"
    assert Deployment("llama-3-8b", "h100", 1) == Deployment("Llama-3-8B", "H100-SXM", 1)


def test_cost_json_is_identical_for_every_spelling(tmp_path, capsys):
    outputs = {_json_bytes(tmp_path, ["cost", *s], f"c{i}.json") for i, s in enumerate(SEED_SPELLINGS)}
    assert len(outputs) == 1
    assert b'"prefill_s": 0.12' in outputs.pop()  # the seed calibration at TP 4, not TP 1's 200 ms


def test_simulate_and_compare_json_are_identical_for_every_spelling(tmp_path, capsys):
    sims = {
        _json_bytes(tmp_path, ["simulate", "--policy", p, *s], f"s{i}.json")
        for i, (s, p) in enumerate(zip(SEED_SPELLINGS, ["vllm", "VLLM", "vLLM", "vllm"]))
    }
    assert len(sims) == 1
    compares = {
        _json_bytes(tmp_path, ["compare", "--policies", p, "--workers", "1", *s], f"m{i}.json")
        for i, (s, p) in enumerate(zip(SEED_SPELLINGS[:2], ["orca,tgi", "ORCA,Tgi"]))
    }
    assert len(compares) == 1


def test_tune_json_is_identical_for_every_spelling(tmp_path, capsys):
    common = ["tune", "--chunk-sizes", "512,2048", "--num-requests", "60", "--workers", "1", "--quiet"]
    spellings = [
        ["--model", "Llama-3-8B", "--hardware", "H100-SXM", "--policies", "vllm"],
        ["--model", "meta-llama/Meta-Llama-3-8B-Instruct", "--hardware", "h100", "--policies", "VLLM"],
    ]
    outputs = {
        _json_bytes(tmp_path, [*common, *s, "--out", str(tmp_path / f"r{i}.jsonl")], f"t{i}.json")
        for i, s in enumerate(spellings)
    }
    assert len(outputs) == 1


def test_cost_checks_fit_and_names_the_minimum_tp(capsys):
    assert main(["cost", "--model", "Falcon-180B", "--hardware", "L4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit on L4 at TP 1" in err[0]
    assert "minimum is TP 29" in err[0]  # 232 heads: the smallest divisor that fits the weights
    assert main(["cost", "--model", "Llama-3-70B", "--hardware", "L4"]) == 2
    assert "minimum is TP 8" in capsys.readouterr().err


def test_bench_predict_spec_carries_the_catalog_names():
    from tailserve.bench.predict import PredictSpec

    canonical = PredictSpec("Llama-3-8B", "H100-SXM")
    assert PredictSpec("meta-llama/Meta-Llama-3-8B-Instruct", "nvidia h100") == canonical
    assert PredictSpec("llama-3-8b", "h100-sxm").label == canonical.label
    with pytest.raises(ValueError, match="unknown model"):
        PredictSpec("no-such-model")
