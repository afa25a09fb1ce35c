"""Sliding-window layers: window-bounded attention aggregates, their pricing, and the KV cache
vLLM's hybrid manager sizes for a model with both kinds of layers."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from tailserve.cli import main
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.kv_capacity import hybrid_groups, hybrid_manager_blocks, kv_capacity
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.window import WindowShape

GPT_OSS = get_model("gpt-oss-120b")
H200 = get_hardware("H200")


def brute(prefill: list[tuple[int, int]], decodes: list[int], w: int) -> WindowShape:
    pairs = sum(min(p + 1, w) for q, c in prefill for p in range(c, c + q))
    kv = sum(len({k for p in range(c, c + q) for k in range(max(0, p - w + 1), p + 1)}) for q, c in prefill)
    return WindowShape(pairs, kv, sum(min(c + 1, w) for c in decodes))


@pytest.mark.parametrize("q,c,w", list(itertools.product((1, 3, 16, 40), (0, 5, 30, 200), (1, 7, 32, 128))))
def test_window_aggregates_match_brute_force(q, c, w):
    assert WindowShape.of([(q, c)], [c], w) == brute([(q, c)], [c], w)


def test_windowed_attention_reads_the_window_only():
    cm = CostModel(GPT_OSS, H200, 1)
    assert cm.windowed
    short, long = [100] * 8, [20_000] * 8
    # within the window every layer reads everything: the window changes nothing
    s = BatchShape.of([], short)
    assert cm.iteration_time(s, WindowShape.of([], short, 128)) == pytest.approx(cm.iteration_time(s))
    # far past it the sliding half reads 128 tokens: about half the KV read
    s = BatchShape.of([], long)
    full, windowed = cm.attention_time(s), cm.attention_time(s, WindowShape.of([], long, 128))
    assert windowed == pytest.approx(full * (18 + 18 * 128 / 20_001) / 36)
    assert cm.iteration_time(s, WindowShape.of([], long, 128)) < cm.iteration_time(s)


def test_a_dense_model_is_priced_as_before():
    cm = CostModel(get_model("Llama-3-8B"), H200, 1)
    assert not cm.windowed
    s = BatchShape.of([(512, 100)], [300] * 4)
    assert cm.iteration_time(s, WindowShape.of([(512, 100)], [300] * 4, 64)) == cm.iteration_time(s)


def test_windowed_models_step_every_iteration_and_agree_with_no_fast_forward(tmp_path, capsys):
    executor = SimExecutor(CostModel(GPT_OSS, H200, 1))
    assert not executor.prices_shapes_alone  # the fast paths price sums: off for windows
    args = ["simulate", "--model", "gpt-oss-20b", "--hardware", "H200", "--workload", "random",
            "--input-len", "600", "--output-len", "40", "--num-requests", "30", "--rate", "4"]  # fmt: skip
    assert main([*args, "--json", str(tmp_path / "a.json")]) == 0
    assert main([*args, "--no-fast-forward", "--json", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))
    assert a["metrics"] == b["metrics"]


def test_hybrid_groups_follow_vllm():
    # gpt-oss: 18 + 18 -> one group of each; Gemma-3-27B-like 52 sliding + 10 full -> 1 + 6 groups
    assert hybrid_groups(GPT_OSS) == (18, 1, 1)
    gemma = replace(GPT_OSS, name="gemma-like", num_layers=62, num_sliding_layers=52, sliding_window=1024)
    assert hybrid_groups(gemma) == (10, 1, 6)
    # 13 full + 12 sliding: padded to 13 each (under 1.5x: the larger count is the group size)
    odd = replace(GPT_OSS, name="odd", num_layers=25, num_sliding_layers=12)
    assert hybrid_groups(odd) == (13, 1, 1)


def test_hybrid_capacity_never_overcommits_the_pool():
    for model, seqs in ((GPT_OSS, 256), (GPT_OSS, 4096), (replace(GPT_OSS, name="g", num_layers=62,
                         num_sliding_layers=52, sliding_window=1024), 256)):  # fmt: skip
        _, full, sliding = hybrid_groups(model)
        pool = 100_000
        blocks = hybrid_manager_blocks(model, pool, 16, seqs)[0]
        window_pages = -(-(model.sliding_window - 1) // 16) + 1
        # every manager block is a page in each full group; each of ``seqs`` running requests
        # holds at most its window in each sliding group — or, at the even split, no more
        # sliding pages than full ones
        assert blocks * full + seqs * sliding * window_pages <= pool or blocks == pool // (full + sliding)
        assert blocks >= pool // (full + sliding)


def test_gpt_oss_holds_about_twice_the_tokens_of_a_uniform_cache():
    uniform = kv_capacity(GPT_OSS, H200, 1, 0.9, 16, 8192)  # max_num_seqs unknown: even split
    hybrid = kv_capacity(GPT_OSS, H200, 1, 0.9, 16, 8192, max_num_seqs=256)
    dense_sized = replace(GPT_OSS, num_sliding_layers=0, sliding_window=0)
    plain = kv_capacity(dense_sized, H200, 1, 0.9, 16, 8192)
    assert uniform.num_blocks == plain.num_blocks  # the even split: vLLM's logged KV size
    assert 1.9 < hybrid.num_blocks / plain.num_blocks < 2.0


def test_mla_with_windows_is_refused():
    with pytest.raises(ValueError, match="sliding-window layers with MLA"):
        replace(get_model("deepseek-v3"), num_sliding_layers=2, sliding_window=128)
