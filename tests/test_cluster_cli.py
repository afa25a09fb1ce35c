"""``tailserve simulate`` with the cluster options: a run end to end, and one-line errors."""

from __future__ import annotations

import json

import pytest

from tailserve.cli.app import main

SMALL = [
    "--model",
    "Llama-3.1-8B",
    "--hardware",
    "H100",
    "--workload",
    "shared-prefix",
    "--num-requests",
    "60",
    "--rate",
    "10",
]


def test_replicas_with_a_router_writes_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert (
        main(
            [
                "simulate",
                *SMALL,
                "--replicas",
                "3",
                "--router",
                "prefix-aware:cache_threshold=0.5",
                "--explain",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "router prefix-aware:cache_threshold=0.5" in text and "routing (prefix-aware" in text
    data = json.loads(out.read_text())
    assert data["num_finished"] == 60
    assert [r["name"] for r in data["stages"]["replicas"]["replicas"]] == ["r0", "r1", "r2"]
    assert sum(r["num_routed"] for r in data["stages"]["replicas"]["replicas"]) == 60
    assert "lines" in data["explanation"]


def test_heterogeneous_cluster_and_pd(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["simulate", *SMALL, "--cluster", "1xH100:tp1,1xA100-80GB:tp2", "--json", str(out)]) == 0
    replicas = json.loads(out.read_text())["stages"]["replicas"]["replicas"]
    assert [r["deployment"] for r in replicas] == ["H100-SXM:tp1", "A100-80GB:tp2"]
    assert (
        main(
            [
                "simulate",
                *SMALL,
                "--prefill-replicas",
                "1",
                "--decode-replicas",
                "2",
                "--kv-link",
                "roce-100g",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert set(data["stages"]) == {"prefill", "decode"} and data["kv_transfer_s"]["p50"] > 0
    assert "KV transfer" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["--cluster", "2xH900"], "--cluster item '2xH900': unknown hardware 'H900'"),
        (["--cluster", "2xH100:tpx"], "is not [COUNTx]GPU[:tpN]"),
        (["--replicas", "2", "--router", "fastest"], "unknown router 'fastest'"),
        (
            ["--replicas", "2", "--router", "prefix-aware:cache_threshold=2"],
            "cache_threshold must be in [0, 1]",
        ),
        (["--prefill-replicas", "1"], "--prefill-replicas and --decode-replicas go together"),
        (["--replicas", "2", "--cluster", "1xH100"], "--replicas and --cluster are alternatives"),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-policy", "tgi"],
            "--decode-policy tgi: a decode replica must admit",
        ),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-policy", "sglang"],
            "--prefill-policy vllm: an SGLang decode server pairs with SGLang prefill servers",
        ),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-link", "pigeon"],
            "unknown KV link 'pigeon'",
        ),
        (
            ["--replicas", "2", "--save-run", "x.json"],
            "--iterations, --save-run and --report describe one engine",
        ),
        (["--replicas", "2", "--decode-policy", "vllm"], "need --prefill-replicas/--decode-replicas"),
        (["--replicas", "2", "--scrape-interval", "-1"], "scrape_interval must be >= 0"),
    ],
)
def test_bad_cluster_options_are_one_line(argv, message, capsys):
    assert main(["simulate", *SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cluster_items_without_a_tp_take_the_commands_default():
    from tailserve.cluster.spec import parse_cluster
    from tailserve.policies.registry import PolicySpec

    spec = PolicySpec.make("vllm", {})
    seed = parse_cluster("2xA100-80GB,H100:tp2", "Llama-3-70B", spec)
    assert [s.deployment.tp for s in seed] == [4, 4, 2]  # the seed deployment's TP 4, as simulate's
    assert [s.deployment.tp for s in parse_cluster("2xH100", "Llama-3.1-8B", spec)] == [1, 1]
    assert [s.deployment.tp for s in parse_cluster("A100-80GB", "Llama-3-70B", spec, tp=8)] == [8]


def test_cluster_items_keep_the_runs_formats_and_parallelism():
    """An item sets its GPU, TP and PP; --quantization, --kv-cache-dtype, expert parallelism and
    the kernels are the run's, on every replica (they were dropped: fp8 ran as bf16)."""
    from tailserve.cluster.spec import parse_cluster
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.policies.registry import PolicySpec

    base = Deployment.of(
        "Qwen3-30B-A3B", "H100-SXM", 2, quantization="fp8", kv_cache_dtype="fp8", expert_parallel=True
    )
    specs = parse_cluster(
        "H100-SXM:tp2,A100-80GB", "Qwen3-30B-A3B", PolicySpec.make("vllm", {}), tp=2, base=base
    )
    for s in specs:
        d = s.deployment
        assert (d.quantization, d.kv_cache_dtype, d.expert_parallel, d.tp) == ("fp8", "fp8", True, 2)
    assert [s.deployment.hardware for s in specs] == ["H100-SXM", "A100-80GB"]
