"""AISimulate's measured MLA module times as the MLA block's time: ``--calibration aisim:FILE``.

The vLLM export ``benchmarks/_aisim_tables.py`` writes holds, per Hopper and Blackwell GPU,
``mla_context`` and ``mla_generation`` rows [projections' format, heads, batch, length, ms]: vLLM
0.25's whole MLA module of one layer (the q/kv down- and up-projections, the attention kernel,
o_proj, the norms, RoPE and cache writes between them) at DeepSeek-V3's shapes, 1-128 heads
(one TP shard's), bf16 KV cache. Context rows time ``batch`` prompts of ``length`` tokens each;
generation rows ``batch`` decodes at ``length`` tokens of KV each. A deployment whose series is
timed exactly (DeepSeek-V3's MLA shapes, which Kimi-K2 shares; its heads per TP shard; its
projections' format, bf16 or block FP8; bf16 KV) is priced from them instead of from the
catalog's fitted ``hardware.MlaKernel``:

- a step's prefill part is the context series at (chunks, prefill tokens / chunks), the chunks
  taken as equal; what the rows cannot hold, the pairs and KV beyond those equal prompts' own
  (a chunk's earlier context, unequal chunks' extra causal pairs), is the catalog's prefill
  attention (its roofline rates, ``CostModel._attention``): the rows time no prompt with cached
  context, and their growth with the prompt length at equal tokens is that attention's;
- its decode part is the generation series at (decodes, the decodes' mean context);
- within a series, log time is interpolated bilinearly in log batch and log length: in log length
  along each of the two measured batches around the batch, then in log batch between them. The
  grids are not rectangles (the tables stop at a product of batch and length: B200's context rows
  at 131,072 tokens, the generation rows at 2^25 tokens of KV), so a length past one batch's last
  row is taken from that batch's row extended as below;
- beyond a series' last length or batch (Hopper's context rows stop at 512-token prompts, every
  series at 256 prompts or 1,024 decodes) the last row's achieved fraction of the module's roofline
  is held (``module_roofline``: the projections' FLOPs at the format's peak and the attention's at
  bf16's, or the weights, activations and KV at the bandwidth), so the time grows with the work
  instead of being clamped: a 32K-token prompt is 50x a 512-token one's attention FLOPs. On the
  Blackwell context rows past 512 tokens, priced from the rows up to 512 alone, this gave a lower
  error than a clamp and than the catalog's (docs/fidelity.md, ``benchmarks/fidelity_aisim_mla_table.py``).

A series the tables lack (another head count or MLA shape, another projections' format, an FP8 KV
cache, a GPU without MLA rows) keeps the catalog's ``MlaKernel`` (``MlaTable.why_outside`` says
why, in the note the table path prints).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.models import ModelSpec
from tailserve.executors.simulated.precision import get_precision

PHASES = ("context", "generation")
# The projections' format (tailserve's name) -> the tables' gemm_type
TABLE_FORMATS = {"bf16": "bfloat16", "fp8_block": "fp8_block"}
# The MLA shapes the tables time: DeepSeek-V3's (hidden, q_lora_rank, kv_lora_rank, qk_nope,
# qk_rope, v_head); Kimi-K2 shares them.
TIMED_SHAPE = (7168, 1536, 512, 128, 64, 128)
ACT_BYTES = 2.0  # activations and the KV cache in bf16
_MEMO_LIMIT = 100_000  # entries a table's memo keeps before starting over (a long run's decode contexts)


def mla_shape(m: ModelSpec) -> tuple[int, ...]:
    return (
        m.hidden_size,
        m.q_lora_rank,
        m.kv_lora_rank,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
    )


@dataclass(frozen=True, eq=False)
class Grid:
    """One series' rows: the measured batches (ascending) and, per batch, its lengths (ascending)
    and seconds, both as logs."""

    batch: np.ndarray
    log_length: tuple[np.ndarray, ...]
    log_seconds: tuple[np.ndarray, ...]

    @staticmethod
    def of(points: list[tuple[float, float, float]]) -> Grid:
        """From (batch, length, seconds); a repeated (batch, length) keeps its first row."""
        by: dict[float, dict[float, float]] = {}
        for b, n, s in points:
            by.setdefault(b, {}).setdefault(n, s)
        batch = np.array(sorted(by))
        lengths = [np.array(sorted(by[b])) for b in batch]
        seconds = [np.array([by[b][n] for n in ls]) for b, ls in zip(batch, lengths)]
        return Grid(batch, tuple(np.log(ls) for ls in lengths), tuple(np.log(s) for s in seconds))


@dataclass(frozen=True, eq=False)
class MlaRows:
    """One GPU's MLA module rows of an export: per (phase, table format, heads) a ``Grid``, and
    each phase's version (vLLM's and its backend's)."""

    series: dict[tuple[str, str, int], Grid]
    versions: dict[str, str]

    @staticmethod
    def of(entry: dict) -> MlaRows | None:
        """From a GPU's entry of the export; rows that are not [str, 4 numbers > 0] are left out.
        None without rows of both phases."""
        series: dict[tuple[str, str, int], Grid] = {}
        for phase in PHASES:
            points: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
            rows = entry.get(f"mla_{phase}")
            for r in rows if isinstance(rows, list) else ():
                if not (isinstance(r, list) and len(r) == 5 and isinstance(r[0], str)):
                    continue
                if not all(isinstance(x, (int, float)) and x > 0 for x in r[1:]):
                    continue
                points.setdefault((r[0], int(r[1])), []).append(
                    (float(r[2]), float(r[3]), float(r[4]) * 1e-3)
                )
            for (fmt, heads), pts in points.items():
                series[(phase, fmt, heads)] = Grid.of(pts)
        if not {p for p, _, _ in series} >= set(PHASES):
            return None
        versions = {p: str(entry.get(f"mla_{p}_version", "")) for p in PHASES}
        return MlaRows(series, versions)


@dataclass(frozen=True, slots=True)
class ModuleRoofline:
    """The roofline of one MLA layer of the timed shapes on one shard of ``heads`` heads: the
    projections' FLOPs at the format's peak, the attention's at bf16's; the projections' weights,
    their activations in and out and the KV read and written at the bandwidth."""

    proj_flops: float  # per token
    weight_bytes: float
    io_bytes: float  # per token: the projections' inputs and outputs, the KV written
    prefill_pair_flops: float  # per causal (query, key) pair, up-projected K/V
    decode_pair_flops: float  # per (decode, KV token) pair, over the latent (absorbed)
    kv_bytes: float  # per KV token read
    proj_peak: float
    attn_peak: float
    bandwidth: float

    @staticmethod
    def of(heads: int, fmt: str, hw: Hardware) -> ModuleRoofline:
        hidden, q_lora, kv_lora, nope, rope, v = TIMED_SHAPE
        # (K, N) of each projection: q_a, q_b, kv_a (with the RoPE key), kv_b, o
        gemms = ((hidden, q_lora), (q_lora, heads * (nope + rope)), (hidden, kv_lora + rope),
                 (kv_lora, heads * (nope + v)), (heads * v, hidden))  # fmt: skip
        params = sum(k * n for k, n in gemms)
        prec = get_precision(fmt)
        kv = (kv_lora + rope) * ACT_BYTES
        return ModuleRoofline(
            proj_flops=2.0 * params,
            weight_bytes=params * prec.bytes,
            io_bytes=sum(k + n for k, n in gemms) * ACT_BYTES + kv,
            prefill_pair_flops=2.0 * heads * (nope + rope + v),
            decode_pair_flops=2.0 * heads * (2 * kv_lora + rope),
            kv_bytes=kv,
            proj_peak=hw.peak_for(prec.compute),
            attn_peak=hw.peak_flops,
            bandwidth=hw.memory_bandwidth,
        )

    def seconds(self, phase: str, batch, length):
        """``batch`` prompts of ``length`` tokens (context) or decodes at ``length`` tokens of KV
        (generation); numbers or arrays."""
        if phase == "context":
            tokens = batch * length
            pairs = batch * length * (length + 1) / 2.0
            compute = (
                tokens * self.proj_flops / self.proj_peak + pairs * self.prefill_pair_flops / self.attn_peak
            )
            memory = (self.weight_bytes + tokens * self.io_bytes + tokens * self.kv_bytes) / self.bandwidth
        else:
            pairs = batch * length
            compute = (
                batch * self.proj_flops / self.proj_peak + pairs * self.decode_pair_flops / self.attn_peak
            )
            memory = (self.weight_bytes + batch * self.io_bytes + pairs * self.kv_bytes) / self.bandwidth
        return np.maximum(compute, memory)


# How a series' row goes on past its measured lengths: (batch, the edge lengths, their log
# seconds, the lengths asked) -> log seconds at those lengths.
Extend = Callable[[float, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def grid_log_seconds(grid: Grid, batch: float, length, extend: Extend, beyond_batch: Callable) -> np.ndarray:
    """Log seconds of ``batch`` at each ``length`` (a number or an array) in ``grid``: bilinear in
    log batch and log length; past a batch's measured lengths that row goes on by ``extend``;
    beyond the measured batches, ``beyond_batch(batch, measured batch, lengths)`` is added to the
    nearest batch's log seconds."""
    lengths = np.atleast_1d(np.asarray(length, dtype=float))
    x = np.log(lengths)

    def row(i: int) -> np.ndarray:
        ll, ls = grid.log_length[i], grid.log_seconds[i]
        out = np.interp(x, ll, ls)
        outside = (x > ll[-1]) | (x < ll[0])
        if outside.any():
            edge = np.where(x[outside] > ll[-1], len(ll) - 1, 0)
            out[outside] = extend(grid.batch[i], np.exp(ll[edge]), ls[edge], lengths[outside])
        return out

    bs = grid.batch
    j = int(np.searchsorted(bs, batch))
    if j < len(bs) and bs[j] == batch:
        return row(j)
    if j == 0 or j == len(bs):
        i = 0 if j == 0 else len(bs) - 1
        return row(i) + beyond_batch(batch, bs[i], lengths)
    w = (math.log(batch) - math.log(bs[j - 1])) / (math.log(bs[j]) - math.log(bs[j - 1]))
    return (1 - w) * row(j - 1) + w * row(j)


def by_roofline(roof: ModuleRoofline, phase: str) -> Extend:
    """A row goes on at its edge's achieved fraction of ``roof``."""

    def extend(batch: float, edge: np.ndarray, log_t: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return log_t + np.log(roof.seconds(phase, batch, lengths) / roof.seconds(phase, batch, edge))

    return extend


def context_seconds(
    grid: Grid, roof: ModuleRoofline, pair_seconds: float, prompts: float, length: float
) -> float:
    """One layer's module over ``prompts`` prompts of ``length`` tokens from a context ``grid``.
    Past the grid's longest prompt ``E``: the same tokens as prompts of ``E`` (``prompts x length
    / E`` of them: the projections and the rest of the module at the same GEMM sizes), plus
    ``pair_seconds`` for each causal pair beyond theirs (``length x (length - E) / 2`` per
    prompt): the catalog's prefill attention."""
    longest = max(float(np.exp(ll[-1])) for ll in grid.log_length)
    ext, beyond = by_roofline(roof, "context"), batch_by_roofline(roof, "context")
    if length <= longest:
        return float(np.exp(grid_log_seconds(grid, prompts, length, ext, beyond))[0])
    same_tokens = float(np.exp(grid_log_seconds(grid, prompts * length / longest, longest, ext, beyond))[0])
    return same_tokens + pair_seconds * prompts * length * (length - longest) / 2.0


def batch_by_roofline(roof: ModuleRoofline, phase: str) -> Callable:
    """Beyond the measured batches: the nearest batch's achieved fraction of ``roof`` held."""

    def beyond(batch: float, measured: float, lengths: np.ndarray) -> np.ndarray:
        return np.log(roof.seconds(phase, batch, lengths) / roof.seconds(phase, measured, lengths))

    return beyond


@dataclass(frozen=True, eq=False)
class MlaTable:
    """A deployment's MLA block priced from its measured series, or, outside the tables, None
    and why (the catalog's ``MlaKernel`` prices it)."""

    heads: int  # per TP shard
    fmt: str  # the projections' format, tailserve's name
    context: Grid | None  # None: outside
    generation: Grid | None
    roof: ModuleRoofline | None
    pair_seconds: float = 0.0  # the catalog's prefill attention per causal pair and layer
    version: str = ""
    why_outside: str = ""
    _memo: dict[tuple[str, int, float], float] = field(default_factory=dict, repr=False)

    @staticmethod
    def of(
        rows: MlaRows | None, gpu: str, m: ModelSpec, tp: int, fmt: str, hw: Hardware, pair_seconds: float
    ) -> MlaTable:
        """``fmt``: the projections' format; ``hw``: the GPU the rows were timed on (the roofline
        beyond the last rows; the times apply as measured, as the GEMMs' do); ``pair_seconds``:
        the catalog's prefill attention per causal pair and layer (past the last prompt length)."""
        heads = m.num_heads // tp

        def outside(why: str) -> MlaTable:
            return MlaTable(heads, fmt, None, None, None, pair_seconds, "", f"MLA block ({why})")

        if rows is None:
            return outside(f"no MLA module rows for {gpu}")
        if mla_shape(m) != TIMED_SHAPE:
            return outside(f"{m.name}'s MLA shapes are not DeepSeek-V3's, which the rows time")
        kv = get_precision(m.kv_dtype).name if m.kv_dtype else ("bf16" if m.dtype_bytes == 2 else "fp32")
        if kv != "bf16":
            return outside(f"{kv} KV cache: the rows time a bf16 one")
        table_fmt = TABLE_FORMATS.get(get_precision(fmt).name)
        if table_fmt is None:
            return outside(f"{fmt} projections: the rows time {', '.join(TABLE_FORMATS)}")
        if not any(f == table_fmt for _, f, _ in rows.series):
            return outside(f"{fmt} projections: no {table_fmt} rows for {gpu}")
        context = rows.series.get(("context", table_fmt, heads))
        generation = rows.series.get(("generation", table_fmt, heads))
        if context is None or generation is None or m.num_heads % tp:
            return outside(f"{m.num_heads / tp:g} heads per shard: not a head count the rows time")
        roof = ModuleRoofline.of(heads, fmt, hw)
        versions = rows.versions
        version = (
            versions["context"] if versions["context"] == versions["generation"]
            else f"{versions['context']} context, {versions['generation']} generation"
        )  # fmt: skip
        return MlaTable(heads, fmt, context, generation, roof, pair_seconds, version)

    @property
    def priced(self) -> bool:
        """Whether the rows price the block (else the catalog's ``MlaKernel`` does)."""
        return self.context is not None

    @property
    def note(self) -> str:
        """Where the MLA block's times come from, for the table path's notes."""
        if not self.priced:
            return ""
        return (
            f"MLA block ({self.heads} heads per shard, {self.fmt} projections, bf16 KV) priced from "
            f"the MLA module rows of vLLM {self.version}"
        )

    def prefill(self, num_prefills: int, tokens: int) -> float:
        """One layer's module over ``num_prefills`` prompts sharing ``tokens`` new tokens equally
        (memoised: a run sees few chunk counts and sizes)."""
        return self._at("context", num_prefills, tokens / num_prefills)

    def decode(self, num_decodes: int, mean_context):
        """One layer's module over ``num_decodes`` decodes at ``mean_context`` tokens of KV each
        (a number, memoised, or an array)."""
        if isinstance(mean_context, np.ndarray):
            return np.exp(self.log_seconds("generation", num_decodes, mean_context))
        return self._at("generation", num_decodes, float(mean_context))

    def _at(self, phase: str, batch: int, length: float) -> float:
        key = (phase, batch, length)
        t = self._memo.get(key)
        if t is None:
            if len(self._memo) > _MEMO_LIMIT:
                self._memo.clear()
            if phase == "context":
                assert self.context is not None and self.roof is not None
                t = context_seconds(self.context, self.roof, self.pair_seconds, batch, length)
            else:  # np.exp, as the array path takes it: a decode run's steps the same floats either way
                t = float(np.exp(self.log_seconds(phase, batch, length))[0])
            self._memo[key] = t
        return t

    def log_seconds(self, phase: str, batch: float, length) -> np.ndarray:
        """Log seconds of one layer's module at ``batch`` and each ``length`` (the module docstring)."""
        grid = self.context if phase == "context" else self.generation
        assert grid is not None and self.roof is not None
        extend, beyond = by_roofline(self.roof, phase), batch_by_roofline(self.roof, phase)
        return grid_log_seconds(grid, batch, length, extend, beyond)
