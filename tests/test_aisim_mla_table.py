"""``--calibration aisim:FILE``: the MLA block priced from AISimulate's measured MLA module rows
(aisim_mla_table.py), on small synthetic exports (AISimulate itself is not needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tailserve.cli import main
from tailserve.executors.simulated.aisim_mla_table import Grid, MlaRows, MlaTable, context_seconds
from tailserve.executors.simulated.cost_model import BatchShape
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model

H200 = get_hardware("H200")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT_LENGTHS = (1, 16, 32, 64, 128, 256, 512)
GENERATION_LENGTHS = (2, 8, 64, 512, 4096, 32768, 131072)


def _law(phase, heads, batch, length):
    """Milliseconds: a power law in batch and length, whatever bilinear log-log interpolation
    reproduces exactly (its scale by phase and heads)."""
    scale = (0.05 if phase == "context" else 0.03) * (heads / 16) ** 0.5
    return scale * batch**0.6 * length ** (0.4 if phase == "context" else 0.2)


def _mla_rows(phase, heads=(16,), fmts=("fp8_block",)):
    lengths = CONTEXT_LENGTHS if phase == "context" else GENERATION_LENGTHS
    return [[f, h, b, n, _law(phase, h, b, n)] for f in fmts for h in heads for b in BATCHES for n in lengths]


def _export(
    tmp_path, mla=True, heads=(16,), fmts=("fp8_block",), name="aisim.json", fp8kv=False, framework="vllm"
):
    """A tiny export: a few GEMM shapes (the rest outside, on the curve), no MoE rows, and MLA rows."""
    gemm = [[f, float(m), float(n), float(k), 0.01 + 1e-9 * m * n * k / 1e3] for f in ("bfloat16", "fp8_block", "nvfp4")
            for n in (4096, 7168, 18432) for k in (2048, 7168) for m in (1, 64, 4096, 32768)]  # fmt: skip
    entry: dict = {"gemm": gemm}
    if mla:
        entry |= {
            "mla_context": _mla_rows("context", heads, fmts),
            "mla_generation": _mla_rows("generation", heads, fmts),
            "mla_context_version": "0.25.0 FLASH_ATTN_MLA",
            "mla_generation_version": "0.25.0 FLASH_ATTN_MLA",
        }
    if fp8kv:  # TensorRT-LLM's tables: FP8 KV rows too, half the bf16 ones' times
        for phase in ("context", "generation"):
            entry[f"mla_{phase}_fp8kv"] = [[*r[:4], r[4] / 2] for r in _mla_rows(phase, heads, fmts)]
            entry[f"mla_{phase}_version"] = "1.3.0rc20"
    path = tmp_path / name
    path.write_text(json.dumps({"framework": framework, "gpus": {"h200_sxm": entry}}))
    return path


def _deepseek(path, tp=8, **kw):
    return build_cost_model(
        Deployment(model="DeepSeek-V3", hardware="H200", tp=tp, calibration=f"aisim:{path}", **kw)
    )


def test_a_grid_point_is_the_measured_row_and_the_law_is_recovered_between_them(tmp_path):
    rows = MlaRows.of({"mla_context": _mla_rows("context"), "mla_generation": _mla_rows("generation")})
    assert rows is not None
    table = MlaTable.of(rows, "h200_sxm", "vllm", get_model("DeepSeek-V3"), 8, "fp8_block", H200, 1e-12)
    assert table.priced and table.heads == 16
    for b in (1, 8, 256):
        for n in (1, 64, 512):
            assert table.prefill(b, b * n) == pytest.approx(_law("context", 16, b, n) * 1e-3, rel=1e-12)
        for n in (2, 4096, 131072):
            assert table.decode(b, n) == pytest.approx(_law("generation", 16, b, n) * 1e-3, rel=1e-12)
    # between the grid's batches and lengths: bilinear in log batch and log length
    for b, n in ((3, 100), (100, 300), (5, 20)):
        assert table.prefill(b, b * n) == pytest.approx(_law("context", 16, b, n) * 1e-3, rel=1e-9)
    for b, n in ((3, 1000), (200, 20000)):
        assert table.decode(b, n) == pytest.approx(_law("generation", 16, b, n) * 1e-3, rel=1e-9)
    # an array of contexts: the same floats as one by one
    contexts = np.array([10.0, 1000.0, 99999.0])
    assert list(table.decode(24, contexts)) == [table.decode(24, float(c)) for c in contexts]


def test_past_the_longest_prompt_the_same_tokens_plus_the_catalogs_attention_over_the_extra_pairs():
    rows = MlaRows.of({"mla_context": _mla_rows("context"), "mla_generation": _mla_rows("generation")})
    assert rows is not None
    pair_s = 3e-12
    table = MlaTable.of(rows, "h200_sxm", "vllm", get_model("DeepSeek-V3"), 8, "fp8_block", H200, pair_s)
    # one 2,048-token prompt: 4 prompts of 512 (the grid's longest) plus 2,048 x 1,536 / 2 pairs
    want = _law("context", 16, 4, 512) * 1e-3 + pair_s * 2048 * (2048 - 512) / 2
    assert table.prefill(1, 2048) == pytest.approx(want, rel=1e-12)
    grid = Grid.of([(b, n, _law("context", 16, b, n) * 1e-3) for b in BATCHES for n in CONTEXT_LENGTHS])
    assert context_seconds(grid, table.roof, pair_s, 1, 2048) == pytest.approx(want, rel=1e-12)
    # beyond the measured batches the last batch's roofline fraction is held: more than it
    assert table.decode(1024, 1000) > table.decode(256, 1000)


def test_a_deployment_prices_its_mla_block_from_the_rows_as_prefill_part_plus_decode_part(tmp_path):
    built = _deepseek(_export(tmp_path))
    cm, m = built.cost_model, get_model("DeepSeek-V3")
    table = cm._mla_block
    assert table is not None
    assert (
        "MLA block (16 heads per shard, fp8_block projections, bf16 KV) priced from the MLA module rows "
        "of vLLM 0.25.0 FLASH_ATTN_MLA" in built.notes
    )
    assert cm.mla_fixed_time(BatchShape.of([(100, 0)], [500])) == 0.0
    # a mixed batch: 2 prompts of 64 tokens and 10 decodes at 1,000 tokens of context
    shape = BatchShape.of([(64, 0), (64, 0)], [1000] * 10)
    mla = m.num_layers * (table.prefill(2, 128) + table.decode(10, 1001))
    assert cm.attention_time(shape) == pytest.approx(mla, rel=1e-12)
    rest = (
        cm._linear(shape.num_tokens, shape.num_logits) + cm._comm(shape.num_tokens) + cm.efficiency.overhead
    )
    assert cm.iteration_time(shape) == pytest.approx(rest + mla, rel=1e-12)
    # the linear part no longer holds the MLA projections nor the KV writes (the rows time both)
    t = 100
    assert cm._linear(t, 0) == pytest.approx(
        cm._table.layers(t) + cm._experts(t) + t * cm.efficiency.per_token, rel=1e-12
    )
    # a chunk with earlier context: its new tokens from the rows, the catalog's attention over the rest
    chunk = BatchShape.of([(256, 4000)], [])
    extra = cm._attention(256 * 4000, 4000, cm._prefill_rates, cm._prefill_pair_flops)
    assert cm.attention_time(chunk) == pytest.approx(m.num_layers * table.prefill(1, 256) + extra, rel=1e-12)


def test_decode_runs_give_the_same_floats_as_single_steps(tmp_path):
    cm = _deepseek(_export(tmp_path)).cost_model
    steps = cm.decode_step_times(12, 12 * 3000, 5)
    run = cm.decode_run_times(12, 12 * 3000, 5)
    assert list(run) == steps
    assert steps[2] == cm.iteration_time(BatchShape.of([], [3002 - 1] * 12))


def test_a_series_the_tables_lack_keeps_the_catalog_and_says_why(tmp_path):
    with_rows, without = _export(tmp_path), _export(tmp_path, mla=False, name="none.json")
    shape = BatchShape.of([(300, 100)], [2000] * 7)
    cases = (
        (dict(tp=4), "MLA block (32 heads per shard: not a head count the rows time)"),
        (dict(kv_cache_dtype="fp8"), "MLA block (fp8 KV cache: the rows time bf16 ones)"),
    )
    for kw, why in cases:
        built = _deepseek(with_rows, **kw)
        cm = built.cost_model
        assert cm._mla_block is None
        assert cm.mla_outside == why
        note = f"MLA's attention block (projections, attention, fixed terms) keeps the catalog's fitted terms: {why}"
        assert note in built.notes
        # priced as with an export without MLA rows: the catalog's MlaKernel
        other = _deepseek(without, **kw).cost_model
        assert cm.iteration_time(shape) == other.iteration_time(shape)
        assert other.mla_outside == "MLA block (no MLA module rows for h200_sxm)"
    # NVIDIA's R1 NVFP4 keeps the MLA projections in bf16, which these rows do not time
    fp4 = build_cost_model(
        Deployment(model="DeepSeek-R1-FP4", hardware="H200", tp=8, calibration=f"aisim:{with_rows}")
    ).cost_model
    assert (
        fp4.mla_outside == "MLA block (bf16 projections: no bfloat16 rows with a bf16 KV cache for h200_sxm)"
    )


def test_cost_runs_end_to_end_with_the_mla_rows(tmp_path, capsys):
    path = _export(tmp_path)
    out = tmp_path / "cost.json"
    args = ["cost", "--model", "DeepSeek-V3", "--hardware", "H200", "--tp", "8", "--json", str(out)]
    assert main([*args, "--calibration", f"aisim:{path}"]) == 0
    assert (
        "note: MLA block (16 heads per shard, fp8_block projections, bf16 KV) priced"
        in capsys.readouterr().err
    )
    priced = json.loads(out.read_text())
    assert main([*args, "--calibration", f"aisim:{_export(tmp_path, mla=False, name='none.json')}"]) == 0
    catalog = json.loads(out.read_text())
    assert priced["prefill_s"] > 0 and priced["prefill_s"] != catalog["prefill_s"]


def test_tensorrt_llm_rows_price_an_fp8_kv_cache_from_its_own_rows(tmp_path):
    path = _export(tmp_path, fp8kv=True, framework="trtllm")
    built = _deepseek(path, kv_cache_dtype="fp8")
    cm, m = built.cost_model, get_model("DeepSeek-V3")
    assert (
        "MLA block (16 heads per shard, fp8_block projections, fp8 KV) priced from the MLA module rows "
        "of TensorRT-LLM 1.3.0rc20" in built.notes
    )
    shape = BatchShape.of([], [999] * 4)
    assert cm.attention_time(shape) == pytest.approx(
        m.num_layers * _law("generation", 16, 4, 1000) * 1e-3 / 2, rel=1e-9
    )
    # the same file prices a bf16 KV cache from its bf16 rows
    bf16 = _deepseek(path).cost_model
    assert bf16.attention_time(shape) == pytest.approx(2 * cm.attention_time(shape), rel=1e-9)
