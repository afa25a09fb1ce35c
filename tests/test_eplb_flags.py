"""The engines' EPLB flags on a launch line (``tailserve lint`` and ``--engine-cmd``): vLLM's
``--enable-eplb`` / ``--eplb-config``, SGLang's ``--enable-eplb`` / ``--ep-num-redundant-experts``,
TensorRT-LLM's ``moe_config.load_balancer`` read into the deployment's ``enable_eplb`` and
``num_redundant_experts``, refused where the engine refuses them; and `tune`'s printed lines,
which write them back, read back to the same deployment."""

from __future__ import annotations

import json
import shlex

import pytest

from tailserve.engines.flag_spec import DEPLOYMENT, NO_OP, NOT_MODELLED, REFUSED, Given
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.engines.trtllm_options import moe_load_balancer_rule
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.policies.registry import parse_policy_list
from tailserve.tune.commands import command_line

H200 = get_hardware("h200").device_info
VLLM = "vllm serve deepseek-ai/DeepSeek-V3 --tensor-parallel-size 8"
SGLANG = "python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --tp 8"
TRTLLM = "trtllm-serve deepseek-ai/DeepSeek-V3 --tp_size 8"


def experts_of(model: str) -> int:  # what the caller gives translate: engines stay off the model catalog
    return get_model(model).num_experts


def _accepted(d: dict) -> Deployment:
    """The translation's deployment as the CLI builds it (Deployment refuses what the engine does)."""
    return Deployment.of(
        d["model"], "H200", d.get("tp", 1), expert_parallel=d.get("expert_parallel", False), dp=d.get("dp", 1),
        all2all_backend=d.get("all2all_backend", "allgather_reducescatter"),
        enable_eplb=d.get("enable_eplb", False), num_redundant_experts=d.get("num_redundant_experts", 0),
    )  # fmt: skip


def _rows(report) -> dict:
    return {row.flag: row for row in report.rows}


# ---- vLLM ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        """--eplb-config '{"num_redundant_experts": 32, "window_size": 500, "use_async": false}'""",
        "--eplb-config.num_redundant_experts 32 --eplb-config.window_size 500 --eplb-config.use_async false",
    ],
)
def test_vllm_032_takes_eplb_and_its_redundant_experts(config):
    report = lint(f"{VLLM} --enable-expert-parallel --enable-eplb {config}")
    assert not report.refused
    rows = _rows(report)
    assert rows["--enable-eplb"].verdict == DEPLOYMENT
    assert (
        rows["--enable-eplb"].source
        == "vllm/engine/arg_utils.py:1320@v0.32.0; vllm/config/parallel.py:205@v0.32.0"
    )
    eplb = next(row for row in report.rows if row.name == "eplb_config")
    assert eplb.verdict == DEPLOYMENT and "num_redundant_experts 32" in eplb.what
    assert "not simulated: window_size, use_async" in eplb.what
    assert eplb.source.startswith("vllm/engine/arg_utils.py:1321@v0.32.0")
    back = translate(report, H200)
    assert back.deployment["enable_eplb"] is True and back.deployment["num_redundant_experts"] == 32
    assert back.ignored == (
        "--eplb-config window_size (not modelled)",
        "--eplb-config use_async (not modelled)",
    )
    assert "--enable-eplb --num-redundant-experts 32" in back.summary(report)
    built = _accepted(back.deployment)
    assert built.enable_eplb and built.num_redundant_experts == 32 and built.expert_parallel


def test_vllm_refuses_eplb_without_expert_parallelism():
    report = lint(f"{VLLM} --enable-eplb")
    assert report.refused
    (finding,) = report.conflicts
    assert finding.verdict == REFUSED and finding.what == "enable_expert_parallel must be True to use EPLB."
    assert finding.source == "vllm/config/parallel.py:565-566@v0.32.0"
    with pytest.raises(ValueError, match="enable_expert_parallel must be True to use EPLB"):
        translate(report, H200)
    # ... and on one rank, and redundant experts without EPLB (vLLM's own messages)
    (one,) = lint("vllm serve deepseek-ai/DeepSeek-V3 --enable-expert-parallel --enable-eplb").conflicts
    assert (
        one.what == "EPLB requires tensor, prefill-context, or data parallelism, but got TP=1, PCP=1, DP=1."
    )
    (off,) = lint(f"{VLLM} --enable-expert-parallel --eplb-config.num_redundant_experts 8").conflicts
    assert off.what.startswith("num_redundant_experts is set to 8 but EPLB is not enabled.")
    assert off.source == "vllm/config/parallel.py:581-587@v0.32.0"


def test_vllm_eplb_config_keys_as_each_version_reads_them():
    bad = """--eplb-config '{"num_redundant_experts": 16, "bogus": 1}'"""
    line = f"{VLLM} --enable-expert-parallel --enable-eplb {bad}"
    # 0.32's configs forbid other keys; 0.11's pydantic dataclass ignores them
    assert "Unexpected keyword argument" in lint(line).conflicts[0].what
    old = lint(f"{line} --num-redundant-experts 32", "0.11")
    assert not old.refused
    eplb = _rows(old)["--eplb-config"]
    assert "ignored by vLLM 0.11.0 (not EPLBConfig fields): bogus" in eplb.what
    assert "replaced by --num-redundant-experts 32" in eplb.what
    # 0.11's deprecated flag is forwarded over the config's (arg_utils.py:1307-1308@v0.11.0)
    assert translate(old, H200).deployment["num_redundant_experts"] == 32
    assert _rows(old)["--num-redundant-experts"].verdict == DEPLOYMENT
    assert _rows(lint(f"{line} --eplb-window-size 10", "0.11"))["--eplb-window-size"].verdict == NOT_MODELLED
    negative = lint(
        f"""{VLLM} --enable-expert-parallel --enable-eplb --eplb-config '{{"num_redundant_experts": -1}}'"""
    )
    assert "num_redundant_experts must be >= 0" in negative.conflicts[0].what


def test_vllm_eplb_config_without_eplb_does_nothing():
    report = lint(f"""{VLLM} --enable-expert-parallel --eplb-config '{{"window_size": 10}}'""")
    assert not report.refused and _rows(report)["--eplb-config"].verdict == NO_OP
    assert "enable_eplb" not in translate(report, H200).deployment


# ---- SGLang ----------------------------------------------------------------------------------


def test_sglang_takes_eplb_and_its_redundant_experts():
    report = lint(
        f"{SGLANG} --ep-size 8 --enable-eplb --ep-num-redundant-experts 32 --eplb-rebalance-num-iterations 500"
    )
    assert not report.refused
    rows = _rows(report)
    assert rows["--enable-eplb"].verdict == DEPLOYMENT
    assert rows["--enable-eplb"].source == "sglang/srt/arg_groups/fields/exec_.py:922@v0.5.23"
    assert rows["--ep-num-redundant-experts"].verdict == DEPLOYMENT
    assert rows["--ep-num-redundant-experts"].source == "sglang/srt/arg_groups/fields/exec_.py:914@v0.5.23"
    assert rows["--eplb-rebalance-num-iterations"].verdict == NOT_MODELLED
    back = translate(report, H200)
    assert back.deployment["enable_eplb"] is True and back.deployment["num_redundant_experts"] == 32
    assert back.ignored == ("--eplb-rebalance-num-iterations (not modelled)",)
    assert _accepted(back.deployment).num_redundant_experts == 32


def test_sglang_refuses_eplb_without_an_expert_parallel_size():
    report = lint(f"{SGLANG} --enable-eplb")
    (finding,) = report.conflicts
    assert finding.verdict == REFUSED and "ep_size > 1" in finding.what
    assert finding.source.startswith("sglang/srt/arg_groups/parallel_hook.py:790-791@v0.5.23")
    with pytest.raises(ValueError, match="EPLB needs an expert-parallel size > 1"):
        translate(report, H200)
    # A DeepEP exchange sets ep_size to tp_size as SGLang resolves it (overrides.py _a2a_ep_size)
    dp = lint(
        f"{SGLANG} --dp 8 --enable-dp-attention --moe-a2a-backend deepep --enable-eplb --ep-num-redundant-experts 32"
    )
    assert not dp.refused
    d = translate(dp, H200).deployment
    assert d["expert_parallel"] is True and d["tp"] == 1 and d["dp"] == 8 and d["enable_eplb"]
    assert _accepted(d).num_redundant_experts == 32


def test_sglang_redundant_experts_without_eplb_are_placed_by_index():
    report = lint(f"{SGLANG} --ep-size 8 --ep-num-redundant-experts 32")
    row = _rows(report)["--ep-num-redundant-experts"]
    assert row.verdict == NOT_MODELLED and "by index" in row.what
    back = translate(report, H200)
    assert "num_redundant_experts" not in back.deployment
    assert back.ignored == ("--ep-num-redundant-experts (not modelled)",)


# ---- TensorRT-LLM ----------------------------------------------------------------------------


def _trtllm(tmp_path, monkeypatch, options: str, flags: str = "--ep_size 8"):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "opts.yaml").write_text(options)
    return lint(f"{TRTLLM} {flags} --extra_llm_api_options opts.yaml")


@pytest.mark.parametrize(
    ("options", "balancer"),
    [
        ("moe_config: {load_balancer: {num_slots: 288, layer_updates_per_iter: 1}}", None),
        (
            "moe_config:\n  backend: WIDEEP\n  load_balancer: ./moe_load_balancer.yaml\n",
            "num_slots: 288\nlayer_updates_per_iter: 1\n",
        ),
        (
            "moe_config: {load_balancer: ./lb.yaml}",
            "num_slots: 288\ninitial_global_assignments: {0: [0, 1]}\n",
        ),
    ],
)
def test_trtllm_load_balancer_slots_are_the_models_experts_and_the_redundant_ones(
    options, balancer, tmp_path, monkeypatch
):
    if balancer is not None:
        (tmp_path / options.split("load_balancer: ")[1].strip(" }\n")).write_text(balancer)
    report = _trtllm(tmp_path, monkeypatch, options)
    assert not report.refused
    row = _rows(report)["opts.yaml:moe_config"]
    assert row.verdict == DEPLOYMENT and "MoeConfig.load_balancer" in row.source
    (finding,) = moe_load_balancer_rule(Given(report.values))
    assert finding.verdict == DEPLOYMENT and "288 expert slots over 8 EP ranks" in finding.what
    back = translate(report, H200, experts=experts_of)
    # DeepSeek-V3's 256 routed experts + 32 redundant
    assert back.deployment["enable_eplb"] is True and back.deployment["num_redundant_experts"] == 32
    assert back.taken[-1] == "opts.yaml:moe_config" and not back.ignored
    assert _accepted(back.deployment).num_redundant_experts == 32
    # without the model's experts: EPLB, no redundant experts, said
    blind = translate(report, H200)
    assert blind.deployment["enable_eplb"] is True and "num_redundant_experts" not in blind.deployment
    assert blind.ignored == (
        "opts.yaml:moe_config num_slots 288 (the model's experts are not known here: EPLB without redundant experts)",
    )


@pytest.mark.parametrize(
    ("options", "flags", "verdict", "said"),
    [
        # layer_updates_per_iter 0 without initial_global_assignments: the default placement, by index
        ("moe_config: {load_balancer: {num_slots: 288}}", "--ep_size 8", NOT_MODELLED, "static routing"),
        # no expert parallelism: maybe_create_moe_load_balancer makes none
        (
            "moe_config: {load_balancer: {num_slots: 288, layer_updates_per_iter: 1}}",
            "",
            NO_OP,
            "no load balancer",
        ),
        ("moe_config: {load_balancer: {num_slots: 0}}", "--ep_size 8", NO_OP, "disabled"),
    ],
)
def test_trtllm_load_balancers_it_does_not_simulate(options, flags, verdict, said, tmp_path, monkeypatch):
    report = _trtllm(tmp_path, monkeypatch, options, flags)
    (finding,) = moe_load_balancer_rule(Given(report.values))
    assert finding.verdict == verdict and said in finding.what
    back = translate(report, H200)
    assert "enable_eplb" not in back.deployment
    assert back.ignored[0].startswith(f"opts.yaml:moe_config ({verdict}: ")


def test_trtllm_refuses_slots_that_do_not_split_and_a_missing_file(tmp_path, monkeypatch):
    report = _trtllm(
        tmp_path, monkeypatch, "moe_config: {load_balancer: {num_slots: 290, layer_updates_per_iter: 1}}"
    )
    (finding,) = moe_load_balancer_rule(Given(report.values))
    assert (
        finding.verdict == REFUSED and finding.what == "`num_slots` (290) must be divisible by `ep_size` (8)."
    )
    with pytest.raises(ValueError, match=r"`num_slots` \(290\) must be divisible"):
        translate(report, H200)
    bad = _trtllm(tmp_path, monkeypatch, "moe_config: {load_balancer: {num_slots: 288, layers: 1}}")
    assert moe_load_balancer_rule(Given(bad.values))[0].verdict == REFUSED
    missing = _trtllm(tmp_path, monkeypatch, "moe_config: {load_balancer: ./nowhere.yaml}")
    assert (
        "warning: the load balancer file ./nowhere.yaml is not there"
        in moe_load_balancer_rule(Given(missing.values))[0].what
    )
    with pytest.raises(ValueError, match=r"MoE load balancer file \./nowhere\.yaml is not there"):
        translate(missing, H200)
    few = _trtllm(
        tmp_path, monkeypatch, "moe_config: {load_balancer: {num_slots: 128, layer_updates_per_iter: 1}}"
    )
    with pytest.raises(ValueError, match="num_slots 128 is below deepseek-ai/DeepSeek-V3's 256 experts"):
        translate(few, H200, experts=experts_of)


# ---- tune's lines read back ------------------------------------------------------------------

EPLB = Deployment.of(
    "DeepSeek-V3", "H200", 8, expert_parallel=True, enable_eplb=True, num_redundant_experts=32
)


@pytest.mark.parametrize("policy", ["vllm", "sglang", "trtllm"])
@pytest.mark.parametrize(
    "deployment",
    [
        EPLB,
        Deployment.of("DeepSeek-V3", "H200", 8, expert_parallel=True, enable_eplb=True),  # rearranging only
        Deployment.of(
            "DeepSeek-V3", "H200", 1, dp=8, expert_parallel=True, enable_eplb=True, num_redundant_experts=32
        ),
    ],
)
def test_tunes_line_reads_back_to_the_same_eplb(policy, deployment, tmp_path, monkeypatch):
    line = command_line(parse_policy_list(policy)[0], deployment, None, H200, 8192)
    if policy == "trtllm":  # its options YAML written as the echo would (helpers.trtllm_line_read_back)
        echo, _, line = line.partition(" && ")
        words = shlex.split(echo)
        monkeypatch.chdir(tmp_path)
        (tmp_path / words[3]).write_text(words[1])
    back = translate(lint(line), H200, experts=experts_of)
    assert _accepted(back.deployment) == deployment
    assert not back.ignored


def test_tunes_lines_spell_eplb_as_each_engine_does():
    lines = {
        p: command_line(parse_policy_list(p)[0], EPLB, None, H200, 8192) for p in ("vllm", "sglang", "trtllm")
    }
    assert f"--enable-eplb --eplb-config '{json.dumps({'num_redundant_experts': 32})}'" in lines["vllm"]
    assert "--ep-size 8 --enable-eplb --ep-num-redundant-experts 32" in lines["sglang"]
    assert "moe_config: {load_balancer: {num_slots: 288, layer_updates_per_iter: 1}}" in lines["trtllm"]
    assert "--ep_size 8" in lines["trtllm"]


# ---- the line runs with it (simulate --engine-cmd) and lint says what TensorRT-LLM makes of it --
def _simulate_engine_cmd(line: str) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "tailserve", "simulate", "--hardware", "H200", "--workload", "chat",
         "--num-requests", "10", "--expert-imbalance", "0.42", "--engine-cmd", line],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stderr


def test_an_engine_lines_eplb_runs_in_the_simulation(tmp_path, monkeypatch):
    said = _simulate_engine_cmd(
        f"""{VLLM} --enable-expert-parallel --enable-eplb --eplb-config '{{"num_redundant_experts": 32}}'"""
    )
    assert "--enable-eplb --num-redundant-experts 32" in said
    assert "EPLB with 32 redundant experts over 8 EP ranks" in said and "(1.42x without EPLB)" in said
    # TensorRT-LLM's slots are the model's experts plus the redundant ones
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lb.yaml").write_text(
        "enable_attention_dp: true\nmoe_config: {load_balancer: {num_slots: 288, layer_updates_per_iter: 1}}\n"
    )
    said = _simulate_engine_cmd(f"{TRTLLM} --ep_size 8 --extra_llm_api_options lb.yaml")
    assert "--enable-eplb --num-redundant-experts 32 --dp 8" in said
    assert "EPLB with 32 redundant experts over 8 EP ranks" in said


def test_lint_gives_tensorrt_llms_load_balancer_its_verdict_and_refusal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.yaml").write_text(
        "moe_config: {load_balancer: {num_slots: 288, layer_updates_per_iter: 1}}\n"
    )
    (tmp_path / "bad.yaml").write_text(
        "moe_config: {load_balancer: {num_slots: 290, layer_updates_per_iter: 1}}\n"
    )
    ok = lint(f"{TRTLLM} --ep_size 8 --extra_llm_api_options ok.yaml")
    assert not ok.refused
    assert "288 expert slots over 8 EP ranks" in _rows(ok)["ok.yaml:moe_config"].what
    bad = lint(f"{TRTLLM} --ep_size 8 --extra_llm_api_options bad.yaml")
    assert bad.refused


@pytest.mark.parametrize("extra", ["--moe-a2a-backend deepep", "--dp 8 --enable-dp-attention --moe-a2a-backend deepep",
                                   "--ep-size 4 --moe-a2a-backend deepep"])  # fmt: skip
def test_sglangs_deepep_splits_the_experts_whole_as_sglang_resolves_it(extra):
    # _a2a_ep_size: an all-to-all backend sets ep_size to tp_size, whatever --ep-size said
    deployment = translate(lint(f"{SGLANG} {extra}")).deployment
    assert deployment["expert_parallel"] is True
    assert "expert_parallel" not in translate(lint(SGLANG)).deployment


def test_a_launch_lines_eplb_and_the_command_lines_must_agree():
    import subprocess
    import sys

    line = (
        f"""{VLLM} --enable-expert-parallel --enable-eplb --eplb-config '{{"num_redundant_experts": 32}}'"""
    )
    out = subprocess.run(
        [sys.executable, "-m", "tailserve", "simulate", "--hardware", "H200", "--workload", "chat",
         "--num-requests", "5", "--num-redundant-experts", "16", "--enable-eplb", "--engine-cmd", line],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "the engine command's EPLB (32 redundant experts) differ" in out.stderr
