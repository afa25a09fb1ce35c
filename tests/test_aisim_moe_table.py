"""``--calibration aisim:FILE``: the routed experts priced from AISimulate's measured fused-MoE
rows (aisim_moe_table.py), on small synthetic exports (AISimulate itself is not needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tailserve.cli import main
from tailserve.executors.simulated.aisim_moe_table import (
    VLLM_KERNELS,
    MoeRows,
    MoeTable,
    roofline,
)
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.precision import get_precision

H200 = get_hardware("H200")
TOKENS = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024, 1536, 2048,
          3072, 4096, 6144, 8192, 12288, 16384)  # fmt: skip
MIXTRAL = (4096, 14336, 2, 8)  # hidden, intermediate, top-k, experts
QWEN3_235B = (4096, 1536, 8, 128)
TRITON = "vllm_unquantizedfusedmoe_triton_tritonexperts"


def _rooflines(tokens, key, fmt="bf16"):
    prec = get_precision(fmt)
    return roofline(tokens, key, H200.peak_for(prec.compute), H200.memory_bandwidth, prec.bytes)


def _law(tokens, key, fmt="bf16"):
    """A power law in tokens (its scale by the series): what log-log interpolation reproduces."""
    return 1e-5 * key[0] / 4096 * key[4] ** -0.5 * np.asarray(tokens, dtype=float) ** 0.6


def _kernel_law(tokens, key, fmt="bf16"):
    """A realistic law: the roofline's compute at 70% of the peak and its memory at 80% of the
    bandwidth joined with a p-norm, plus 20 us per layer (the catalog's fused-MoE curve's form)."""
    prec = get_precision(fmt)
    t = np.atleast_1d(tokens)
    compute = roofline(t, key, H200.peak_for(prec.compute), np.inf, prec.bytes)
    memory = roofline(t, key, np.inf, H200.memory_bandwidth, prec.bytes)
    return ((compute / 0.7) ** 3 + (memory / 0.8) ** 3) ** (1 / 3) + 20e-6


def _moe_rows(
    law, shapes=(MIXTRAL, QWEN3_235B), tps=(1, 2, 8), eps=(), fmt="bfloat16", kernel=TRITON, tokens=TOKENS
):
    series = [(*s, tp, 1) for s in shapes for tp in tps] + [(*s, 1, ep) for s in shapes for ep in eps]
    return [[fmt, float(t), *key, kernel, float(law([t], key)[0]) * 1e3] for key in series for t in tokens]


def test_a_power_law_in_tokens_is_recovered_at_held_out_token_counts():
    # trained on every other token count, priced at the others and between them
    rows = _moe_rows(_law, tokens=TOKENS[::2])
    key = (*QWEN3_235B, 8, 1)
    table = MoeTable.of(MoeRows.of(rows), "h200_sxm", "vllm", "bf16", key, False, H200)
    assert table.priced and table.kernel == TRITON
    for t in (*TOKENS[1::2], 3, 100, 5000):
        assert table.seconds(t) == pytest.approx(float(_law([t], key)[0]), rel=1e-9)
    # beyond the largest measured count the last row's roofline fraction is held
    assert table.seconds(32768) == pytest.approx(
        float(_law([16384], key)[0] * _rooflines([32768], key)[0] / _rooflines([16384], key)[0]), rel=1e-9
    )


def test_a_kernel_law_is_recovered_within_a_few_percent_at_held_out_token_counts():
    # the fused-MoE curve's own form (p-norm join and a fixed time), every other count held out:
    # 1.4% mean, 8.3% at worst (Mixtral at 8 tokens, between 4 and 16: its 8 experts fill up
    # there, a bend log time cuts across)
    rows = _moe_rows(_kernel_law, tokens=TOKENS[::2])
    errors = []
    for key in ((*MIXTRAL, 1, 1), (*MIXTRAL, 8, 1), (*QWEN3_235B, 2, 1)):
        table = MoeTable.of(MoeRows.of(rows), "h200_sxm", "vllm", "bf16", key, False, H200)
        errors += [table.seconds(t) / float(_kernel_law([t], key)[0]) - 1 for t in TOKENS[1::2]]
    assert np.mean(np.abs(errors)) < 0.02 and np.max(np.abs(errors)) < 0.1


def test_a_shape_or_parallelism_outside_the_rows_keeps_the_catalog_curve():
    moe = MoeRows.of(_moe_rows(_law))
    table = MoeTable.of(moe, "h200_sxm", "vllm", "bf16", (*MIXTRAL, 4, 1), False, H200)  # TP 4 not timed
    assert not table.priced
    assert table.why_outside == (
        f"fused MoE 4096 x 14336, top-2 of 8 experts, expert TP 4 bf16 (not a shape "
        f"{TRITON.removeprefix('vllm_')} was timed at)"
    )
    fp8 = MoeTable.of(moe, "h200_sxm", "vllm", "fp8", (*MIXTRAL, 1, 1), False, H200)
    assert not fp8.priced and "(no fp8 fused-MoE rows)" in fp8.why_outside


def test_the_engines_kernel_is_taken_where_the_rows_hold_several():
    law_of = {"vllm_fused_moe": lambda t, k: 2 * _law(t, k, "fp8"), "other": lambda t, k: _law(t, k, "fp8")}
    rows = [r for kn, law in law_of.items() for r in _moe_rows(law, fmt="fp8", kernel=kn)]
    rows += _moe_rows(_law, fmt="fp8", kernel="bigger", shapes=(MIXTRAL, QWEN3_235B, (2048, 768, 8, 128)))
    moe = MoeRows.of(rows)
    assert moe.kernel("h200_sxm", "fp8", "vllm", False) == ("vllm_fused_moe", "")  # vLLM's choice
    assert moe.kernel("h200_sxm", "fp8", "trtllm", False) == ("bigger", "")  # most model shapes
    # vLLM's kernel for static-scale FP8 is not in these rows: not another kernel's instead
    kernel, why = moe.kernel("h200_sxm", "fp8_static", "vllm", False)
    assert (
        kernel is None and why == f"vLLM's kernel {VLLM_KERNELS[('h200_sxm', 'fp8_static')]} not timed here"
    )


def _export(tmp_path, moe_rows, formats=("bfloat16",)):
    """A tiny export: a few GEMM shapes (the rest outside, on the curve) and the MoE rows."""
    gemm = [[f, float(m), float(n), float(k), 0.01 + 1e-9 * m * n * k / 1e3] for f in formats
            for n in (4096, 6144, 14336, 28672) for k in (4096, 14336) for m in (1, 64, 4096, 32768)]  # fmt: skip
    path = tmp_path / "aisim.json"
    path.write_text(json.dumps({"framework": "vllm", "gpus": {"h200_sxm": {"gemm": gemm, "moe": moe_rows}}}))
    return path


def test_a_moe_deployment_prices_its_experts_from_the_rows(tmp_path):
    path = _export(tmp_path, _moe_rows(_law, eps=(2,)))
    built = build_cost_model(
        Deployment(model="Mixtral-8x7B", hardware="H200", tp=2, calibration=f"aisim:{path}")
    )
    cm, m = built.cost_model, get_model("Mixtral-8x7B")
    key = (*MIXTRAL, 2, 1)
    assert built.notes[1] == (
        f"fused MoE (4096 x 14336, top-2 of 8 experts, expert TP 2 bf16) priced from the rows of {TRITON}"
    )
    for t in (1, 100, 4096):
        assert cm._experts(t) == pytest.approx(m.num_moe_layers * float(_law([t], key)[0]), rel=1e-9)
    # with expert parallelism: the EP series of the same kernel
    ep = build_cost_model(
        Deployment(
            model="Mixtral-8x7B", hardware="H200", tp=2, expert_parallel=True, calibration=f"aisim:{path}"
        )
    )
    assert ep.cost_model._experts(100) == pytest.approx(
        m.num_moe_layers * float(_law([100], (*MIXTRAL, 1, 2))[0]), rel=1e-9
    )
    assert "EP 2 bf16) priced from the rows" in ep.notes[1]


def test_experts_outside_the_rows_are_priced_as_the_catalog_prices_them_and_said(tmp_path):
    path = _export(tmp_path, _moe_rows(_law, tps=(1,)))
    built = build_cost_model(
        Deployment(model="Mixtral-8x7B", hardware="H200", tp=2, calibration=f"aisim:{path}")
    )
    cm = built.cost_model
    assert cm.table_notes == ()
    assert "fused MoE 4096 x 14336, top-2 of 8 experts, expert TP 2 bf16 (not a shape" in built.notes[-1]
    assert built.notes[-1].startswith("outside the measured shapes, on the catalog's curve: ")
    catalog = CostModel(get_model("Mixtral-8x7B"), H200, 2)
    for t in (1, 100, 4096):
        assert cm._experts(t) == catalog._experts(t)


def test_cost_runs_end_to_end_on_a_moe_model(tmp_path, capsys):
    path = _export(tmp_path, _moe_rows(_law))
    out = tmp_path / "cost.json"
    args = ["cost", "--model", "Mixtral-8x7B", "--hardware", "H200", "--tp", "2", "--json", str(out)]
    assert main([*args, "--calibration", f"aisim:{path}"]) == 0
    err = capsys.readouterr().err
    assert "note: fused MoE (4096 x 14336, top-2 of 8 experts, expert TP 2 bf16) priced from the rows" in err
    priced = json.loads(out.read_text())
    assert main([*args, "--calibration", "none"]) == 0
    catalog = json.loads(out.read_text())
    assert priced["prefill_s"] > 0 and priced["prefill_s"] != catalog["prefill_s"]


def test_an_mla_model_takes_the_tables_and_keeps_its_mla_block(tmp_path):
    # DeepSeek-V3 (block FP8): the dense GEMMs and the routed experts from the rows, the MLA
    # block's projections on the catalog's terms (its format curve's path on the H200)
    deepseek = (7168, 2048, 8, 256)
    rows = _moe_rows(
        _law, shapes=(deepseek,), tps=(8,), fmt="fp8_block", kernel=VLLM_KERNELS[("h200_sxm", "fp8_block")]
    )
    path = _export(tmp_path, rows, formats=("bfloat16", "fp8_block"))
    built = build_cost_model(
        Deployment(model="DeepSeek-V3", hardware="H200", tp=8, calibration=f"aisim:{path}")
    )
    cm, m = built.cost_model, get_model("DeepSeek-V3")
    assert "priced from the rows of vllm_fp8moe_triton_tritonexperts" in built.notes[1]
    assert built.notes[2].startswith("MLA's attention block")
    catalog = build_cost_model(
        Deployment(model="DeepSeek-V3", hardware="H200", tp=8, calibration="none")
    ).cost_model
    for t in (1, 100, 4096):
        assert cm._experts(t) == pytest.approx(
            m.num_moe_layers * float(_law([t], (*deepseek, 8, 1))[0]), rel=1e-9
        )
        assert cm._mla_projections(t) == catalog._mla_projections(t) > 0
        want = (
            cm._table.layers(t)
            + t * cm._kv_bytes_per_token / cm._byte_rate
            + cm._experts(t)
            + cm._mla_projections(t)
            + t * cm.efficiency.per_token
        )
        assert cm._linear(t, 0) == pytest.approx(want, rel=1e-12)
