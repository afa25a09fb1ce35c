"""Data-parallel deployments on launch lines: SGLang's DP attention and its DeepEP exchange read
(``engines/translate.py``), and the lines `tune` prints for a DP engine read back to it."""

from __future__ import annotations

import pytest

from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.policies.registry import parse_policy_list
from tailserve.tune.commands import command_line

H200 = get_hardware("h200").device_info
SGLANG = (
    "python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-R1 --tp 8 --dp 8 --enable-dp-attention"
)


@pytest.mark.parametrize(
    ("flags", "backend", "note"),
    [
        ("--moe-a2a-backend deepep --deepep-mode low_latency", "deepep_low_latency", None),
        ("--moe-a2a-backend deepep --deepep-mode normal", "deepep_high_throughput", None),
        ("--moe-a2a-backend deepep", "deepep_auto", None),  # SGLang's default mode
        ("--moe-a2a-backend mooncake", None, "--moe-a2a-backend mooncake (not modelled"),
        ("", None, None),
    ],
)
def test_sglangs_exchange_is_the_deployments(flags, backend, note):
    back = translate(lint(f"{SGLANG} {flags}"), H200)
    assert back.deployment.get("all2all_backend") == backend
    assert back.deployment["dp"] == 8 and back.deployment["tp"] == 1
    assert any(i.startswith(note) for i in back.ignored) if note else not back.ignored


def test_dp_size_with_dp_attention_is_a_deployment_row():
    rows = {r.flag: r for r in lint(SGLANG).rows}
    assert rows["--dp"].verdict == "deployment" and "attention-DP ranks" in rows["--dp"].what
    plain = {r.flag: r for r in lint("python -m sglang.launch_server --model-path M --dp 2").rows}
    assert plain["--dp"].verdict == "deployment" and "round-robin" in plain["--dp"].what  # replicas


@pytest.mark.parametrize("policy", ["vllm", "sglang"])
@pytest.mark.parametrize(
    "deployment",
    [
        Deployment.of(
            "DeepSeek-V3", "H200", 1, dp=8, expert_parallel=True, all2all_backend="deepep_low_latency"
        ),
        Deployment.of(
            "DeepSeek-V3", "H200", 1, dp=8, expert_parallel=True, all2all_backend="deepep_high_throughput"
        ),
        Deployment.of("DeepSeek-V3", "H200", 2, dp=4, expert_parallel=True),
    ],
)
def test_tunes_line_for_a_dp_engine_reads_back_to_it(policy, deployment):
    line = command_line(parse_policy_list(policy)[0], deployment, None, H200, 8192)
    assert line is not None
    back = translate(lint(line), H200)
    got = Deployment.of(
        "DeepSeek-V3", "H200", back.deployment.get("tp", 1), expert_parallel=back.deployment.get("expert_parallel", False),
        dp=back.deployment.get("dp", 1), all2all_backend=back.deployment.get("all2all_backend", "allgather_reducescatter"),
    )  # fmt: skip
    assert got == deployment and not back.ignored


def _tune(capsys, *argv):
    from tailserve.cli import main

    try:
        rc = main(["tune", "--hardware", "H100-SXM", "--workload", "random", "--num-requests", "30",
                   "--input-len", "300", "--output-len", "20", *argv])  # fmt: skip
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr()


def test_tune_of_a_dp_engine_runs_the_lines_policy(capsys, tmp_path):
    """A DP engine from --engine-cmd (or one --policies) is tuned as that engine: it was tuned as
    --plan-policy's vllm whatever the line said."""
    options = tmp_path / "o.yaml"
    options.write_text("enable_attention_dp: true\n")
    line = f"trtllm-serve Qwen/Qwen3-30B-A3B --tp_size 2 --ep_size 2 --extra_llm_api_options {options}"
    rc, out = _tune(capsys, "--engine-cmd", line)
    assert rc == 0, out.err
    assert "one engine of DP 2 x TP 1, trtllm" in " ".join(out.out.split())
    assert "TensorRT-LLM's attention-DP placement" in " ".join(out.out.split())
    moe = ["--model", "Qwen3-30B-A3B", "--tp", "1", "--data-parallel-size", "2", "--enable-expert-parallel"]
    rc, out = _tune(capsys, *moe, "--policies", "sglang")
    assert rc == 0, out.err
    assert "one engine of DP 2 x TP 1, sglang" in " ".join(out.out.split())
    rc, out = _tune(capsys, *moe, "--policies", "vllm,sglang")
    assert rc == 2 and "give one policy, not 2" in out.err


def test_sglangs_auto_mode_reads_back_and_is_sglangs_only():
    auto = Deployment.of("DeepSeek-V3", "H200", 1, dp=8, expert_parallel=True, all2all_backend="deepep_auto")
    line = command_line(parse_policy_list("sglang")[0], auto, None, H200, 8192)
    assert line is not None and "--moe-a2a-backend deepep --deepep-mode auto" in line
    assert translate(lint(line), H200).deployment["all2all_backend"] == "deepep_auto"
    from tailserve.executors.simulated.deployment import build_cost_model

    with pytest.raises(ValueError, match="deepep_auto is SGLang's --deepep-mode auto"):
        build_cost_model(auto, "vllm")
    build_cost_model(auto, "sglang")


def test_sglangs_auto_mode_prices_each_step_by_whether_a_prompt_runs():
    """Low-latency kernels for a step of decodes, normal ones when any rank extends a prompt
    (SGLang's DeepEPMode.resolve on the group's is_extend_in_batch)."""
    from tailserve.executors.simulated.cost_model import BatchShape
    from tailserve.executors.simulated.deployment import build_cost_model

    def model(backend):
        dep = Deployment.of("DeepSeek-V3", "H200", 1, dp=8, expert_parallel=True, all2all_backend=backend)
        return build_cost_model(dep, "sglang").cost_model

    auto, ll, ht = model("deepep_auto"), model("deepep_low_latency"), model("deepep_high_throughput")
    decode, prompt = BatchShape.of([], [2000] * 64), BatchShape.of([(4096, 0)], [])
    assert auto.iteration_time(decode) == ll.iteration_time(decode) != ht.iteration_time(decode)
    assert auto.iteration_time(prompt) == pytest.approx(ht.iteration_time(prompt), rel=1e-12)
    group = [prompt, decode] + [None] * 6  # one rank extends: every rank runs normal kernels
    assert auto.group_time(group) == pytest.approx(ht.group_time(group), rel=1e-12)
    decodes = [decode, decode] + [None] * 6
    assert auto.group_time(decodes) == ll.group_time(decodes)


def test_compare_refuses_a_lines_data_parallelism_as_it_refuses_the_flag(capsys):
    """compare's runs are single engines: a DP line would run as one rank with all the traffic
    (it did, through --engine-cmd, where --data-parallel-size was refused)."""
    from tailserve.cli import main

    line = "vllm serve Qwen/Qwen3-30B-A3B -tp 1 -dp 2 --enable-expert-parallel"
    argv = [
        "compare",
        "--hardware",
        "H100-SXM",
        "--workload",
        "random",
        "--num-requests",
        "10",
        "--rate",
        "4",
    ]
    assert main([*argv, "--engine-cmd", line]) == 2
    err = capsys.readouterr().err
    assert "the engine commands' data parallelism (DP 2)" in err and "`compare` prices one engine" in err


def test_sglangs_plain_dp_is_a_dense_models_replicas(capsys):
    """``--dp N`` without DP attention: N engines behind SGLang's round-robin controller, which
    is tailserve's DP of a dense model; an MoE model's is refused (tailserve's would be attention
    DP in lockstep). It ran one engine with all the traffic before."""
    from tailserve.cli import main

    argv = ["simulate", "--hardware", "H100-SXM", "--workload", "random", "--num-requests", "12", "--rate", "8",
            "--input-len", "200", "--output-len", "10"]  # fmt: skip
    dense = "python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B --dp 2"
    assert main([*argv, "--engine-cmd", dense]) == 0
    out = capsys.readouterr()
    assert "--dp 2" in out.err and "router round-robin" in " ".join(out.out.split())
    moe = "python -m sglang.launch_server --model-path Qwen/Qwen3-30B-A3B --dp 2"
    assert main([*argv, "--engine-cmd", moe]) == 2
    assert "without --enable-dp-attention runs 2 independent engines" in capsys.readouterr().err
    dep = Deployment.of("Llama-3.1-8B", "H100", 1, dp=2)
    line = command_line(parse_policy_list("sglang")[0], dep, None, H200, 8192)
    assert line is not None and "--dp 2" in line and "--enable-dp-attention" not in line
    assert translate(lint(line), H200).deployment["dp"] == 2
