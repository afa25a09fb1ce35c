"""AISimulate's measured MLA module times as the MLA block's time: ``--calibration aisim:FILE``.

The vLLM export ``benchmarks/_aisim_tables.py`` writes holds, per Hopper and Blackwell GPU,
``mla_context`` and ``mla_generation`` rows [projections' format, heads, batch, length, ms]: vLLM
0.25's whole MLA module of one layer (the q/kv down- and up-projections, the attention kernel,
o_proj, the norms, RoPE and cache writes between them) at DeepSeek-V3's shapes, 1-128 heads
(one TP shard's), bf16 KV cache. Context rows time ``batch`` prompts of ``length`` tokens each;
generation rows ``batch`` decodes at ``length`` tokens of KV each. The TensorRT-LLM export
(``--framework trtllm``) holds TensorRT-LLM 1.3's own modules the same way, with a bf16 and an
FP8 KV cache (``mla_{phase}_fp8kv``) and NVFP4 projections too. A deployment whose series is
timed exactly (DeepSeek-V3's MLA shapes, which Kimi-K2 shares; its heads per TP shard; its
projections' format; its KV cache's format) is priced from them instead of from the catalog's
fitted ``hardware.MlaKernel``:

- a step's prefill part is the context series at (chunks, prefill tokens / chunks), the chunks
  taken as equal; what the rows cannot hold, the pairs and KV beyond those equal prompts' own
  (a chunk's earlier context, unequal chunks' extra causal pairs), is the catalog's prefill
  attention (its rates, ``CostModel._attention``): the rows time no prompt with cached context,
  and the same attention prices prompts past the longest the rows time (below), where it does
  better than the alternatives on the rows that test it;
- its decode part is the generation series at (decodes, the decodes' mean context);
- within a series, log time is interpolated bilinearly in log batch and log length: along the
  lengths of the two measured batches around the batch, then between them. The grids are not
  rectangles (B200's context rows stop at 131,072 tokens, the generation rows at 2^25 tokens of
  KV): where a measured batch's lengths end before the length asked, along the batches of the two
  measured lengths around it instead (``grid_log_seconds``); where neither way is inside the
  grid, the nearest measured point's achieved fraction of the module's roofline is held
  (``ModuleRoofline``: the projections' FLOPs at the format's peak and the attention's at bf16's,
  or the weights, activations and KV at the bandwidth): beyond 256 prompts or 1,024 decodes, past
  131,072 tokens of context, below the shortest rows;
- past the longest prompt timed (512 tokens on Hopper, 32,768 on Blackwell), a prompt of ``L``
  tokens is the same tokens as prompts of that longest length ``E`` (the projections and the rest
  of the module at the same GEMM sizes) plus the catalog's prefill attention over the ``L (L - E)
  / 2`` causal pairs beyond theirs (``context_seconds``). On the Blackwell context rows past 512
  tokens, priced from the rows up to 512 alone, this rule's mean error was 4.7-6.6%, holding the
  roofline fraction's 56-85% (the edge's fraction is the projections', far below the attention
  kernel's) and holding the time per token's 32-37% (``benchmarks/fidelity_aisim_mla_table.py``,
  docs/fidelity.md).

A series the tables lack (another head count or MLA shape, another projections' format, an FP8 KV
cache in vLLM's rows, a GPU or an export without MLA rows) keeps the catalog's ``MlaKernel`` (``MlaTable.why_outside`` says
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
# The projections' format (tailserve's name) -> the tables' gemm_type (nvfp4: TensorRT-LLM's only)
TABLE_FORMATS = {"bf16": "bfloat16", "fp8_block": "fp8_block", "nvfp4": "nvfp4"}
# The KV cache's format -> the export's key suffix of its rows
KV_KEYS = {"bf16": "", "fp8": "_fp8kv"}
# The engines' names in the notes
ENGINES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "sglang": "SGLang"}
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
class Lines:
    """A series' rows as lines along one axis: the other axis' measured values (ascending) and,
    on each line, its measured values along the axis (ascending) and seconds, both as logs."""

    at: np.ndarray
    log_along: tuple[np.ndarray, ...]
    log_seconds: tuple[np.ndarray, ...]

    @staticmethod
    def of(by: dict[float, dict[float, float]]) -> Lines:
        at = np.array(sorted(by))
        along = [np.array(sorted(by[a])) for a in at]
        seconds = [np.array([by[a][x] for x in xs]) for a, xs in zip(at, along)]
        return Lines(at, tuple(np.log(xs) for xs in along), tuple(np.log(t) for t in seconds))


@dataclass(frozen=True, eq=False)
class Grid:
    """One series' rows: by batch (lengths along each) and by length (batches along each)."""

    rows: Lines
    columns: Lines
    longest: float  # the longest length measured

    @staticmethod
    def of(points: list[tuple[float, float, float]]) -> Grid:
        """From (batch, length, seconds); a repeated (batch, length) keeps its first row."""
        rows: dict[float, dict[float, float]] = {}
        columns: dict[float, dict[float, float]] = {}
        for b, n, s in points:
            if n not in rows.setdefault(b, {}):
                rows[b][n] = s
                columns.setdefault(n, {})[b] = s
        return Grid(Lines.of(rows), Lines.of(columns), max(columns))


@dataclass(frozen=True, eq=False)
class MlaRows:
    """One GPU's MLA module rows of an export: per (phase, table format, heads, KV format) a
    ``Grid``, and each phase's version (vLLM's and its backend's, or TensorRT-LLM's)."""

    series: dict[tuple[str, str, int, str], Grid]
    versions: dict[str, str]

    @staticmethod
    def of(entry: dict) -> MlaRows | None:
        """From a GPU's entry of the export (``mla_{phase}``: bf16 KV, ``mla_{phase}_fp8kv``: FP8
        KV, which only TensorRT-LLM's tables time); rows that are not [str, 4 numbers > 0] are
        left out. None without rows of both phases."""
        series: dict[tuple[str, str, int, str], Grid] = {}
        for phase in PHASES:
            for kv, suffix in KV_KEYS.items():
                points: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
                rows = entry.get(f"mla_{phase}{suffix}")
                for r in rows if isinstance(rows, list) else ():
                    if not (isinstance(r, list) and len(r) == 5 and isinstance(r[0], str)):
                        continue
                    if not all(isinstance(x, (int, float)) and x > 0 for x in r[1:]):
                        continue
                    points.setdefault((r[0], int(r[1])), []).append(
                        (float(r[2]), float(r[3]), float(r[4]) * 1e-3)
                    )
                for (fmt, heads), pts in points.items():
                    series[(phase, fmt, heads, kv)] = Grid.of(pts)
        if not {k[0] for k in series} >= set(PHASES):
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
    io_bytes: float  # per token: the projections' inputs and outputs
    prefill_pair_flops: float  # per causal (query, key) pair, up-projected K/V
    decode_pair_flops: float  # per (decode, KV token) pair, over the latent (absorbed)
    kv_bytes: float  # per KV token read and written
    proj_peak: float
    attn_peak: float
    bandwidth: float

    @staticmethod
    def of(heads: int, fmt: str, hw: Hardware, kv_bytes: float = ACT_BYTES) -> ModuleRoofline:
        hidden, q_lora, kv_lora, nope, rope, v = TIMED_SHAPE
        # (K, N) of each projection: q_a, q_b, kv_a (with the RoPE key), kv_b, o
        gemms = ((hidden, q_lora), (q_lora, heads * (nope + rope)), (hidden, kv_lora + rope),
                 (kv_lora, heads * (nope + v)), (heads * v, hidden))  # fmt: skip
        params = sum(k * n for k, n in gemms)
        prec = get_precision(fmt)
        kv = (kv_lora + rope) * kv_bytes
        return ModuleRoofline(
            proj_flops=2.0 * params,
            weight_bytes=params * prec.bytes,
            io_bytes=sum(k + n for k, n in gemms) * ACT_BYTES,
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
            # the prompt's KV written and read back
            memory = (
                self.weight_bytes + tokens * self.io_bytes + 2 * tokens * self.kv_bytes
            ) / self.bandwidth
        else:
            pairs = batch * length
            compute = (
                batch * self.proj_flops / self.proj_peak + pairs * self.decode_pair_flops / self.attn_peak
            )
            memory = (
                self.weight_bytes + batch * self.io_bytes + (pairs + batch) * self.kv_bytes
            ) / self.bandwidth
        return np.maximum(compute, memory)


def _along(lines: Lines, at: float, along: np.ndarray, roof: Callable) -> tuple[np.ndarray, np.ndarray]:
    """Log seconds at ``at`` and each of ``along`` from ``lines``: linear in the logs along the two
    lines around ``at``, then between them; past a line's ends, or beyond the lines, the nearest
    measured point's fraction of ``roof(at, along)`` held. Also which points needed that."""
    x = np.log(along)

    def line(i: int) -> tuple[np.ndarray, np.ndarray]:
        xs, ts = lines.log_along[i], lines.log_seconds[i]
        out = np.interp(x, xs, ts)
        past = (x > xs[-1]) | (x < xs[0])
        if past.any():
            edge = np.where(x[past] > xs[-1], len(xs) - 1, 0)
            a = lines.at[i]
            out[past] = ts[edge] + np.log(roof(a, along[past]) / roof(a, np.exp(xs[edge])))
        return out, past

    ats = lines.at
    j = int(np.searchsorted(ats, at))
    if j < len(ats) and ats[j] == at:
        return line(j)
    if j == 0 or j == len(ats):
        i = 0 if j == 0 else len(ats) - 1
        out, _ = line(i)
        return out + np.log(roof(at, along) / roof(ats[i], along)), np.ones(len(along), dtype=bool)
    w = (math.log(at) - math.log(ats[j - 1])) / (math.log(ats[j]) - math.log(ats[j - 1]))
    (lo, lo_past), (hi, hi_past) = line(j - 1), line(j)
    return (1 - w) * lo + w * hi, lo_past | hi_past


def grid_log_seconds(grid: Grid, roof: ModuleRoofline, phase: str, batch: float, length) -> np.ndarray:
    """Log seconds of one layer's module at ``batch`` and each ``length`` (a number or an array):
    bilinear in log batch and log length, along the lengths of the two measured batches around
    ``batch`` and then between them; where that goes past a measured batch's lengths (the grids
    are not rectangles) and along the batches of the two measured lengths around it does not,
    that way instead; else the nearest measured point's fraction of ``roof`` held."""
    lengths = np.atleast_1d(np.asarray(length, dtype=float))
    out, past = _along(grid.rows, batch, lengths, lambda b, n: roof.seconds(phase, b, n))
    for k in np.flatnonzero(past):  # few: the grid's edges
        other, other_past = _along(
            grid.columns, float(lengths[k]), np.array([float(batch)]), lambda n, b: roof.seconds(phase, b, n)
        )
        if not other_past[0]:
            out[k] = other[0]
    return out


def context_seconds(
    grid: Grid, roof: ModuleRoofline, pair_seconds: float, prompts: float, length: float
) -> float:
    """One layer's module over ``prompts`` prompts of ``length`` tokens from a context ``grid``.
    Past the grid's longest prompt ``E``: the same tokens as prompts of ``E`` (``prompts x length
    / E`` of them: the projections and the rest of the module at the same GEMM sizes), plus
    ``pair_seconds`` for each causal pair beyond theirs (``length x (length - E) / 2`` per
    prompt): the catalog's prefill attention."""
    e = grid.longest
    if length <= e:
        return float(np.exp(grid_log_seconds(grid, roof, "context", prompts, length))[0])
    same_tokens = float(np.exp(grid_log_seconds(grid, roof, "context", prompts * length / e, e))[0])
    return same_tokens + pair_seconds * prompts * length * (length - e) / 2.0


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
    kv: str = "bf16"  # the KV cache's format
    source: str = ""  # the engine and version whose rows price it, for the note
    why_outside: str = ""
    _memo: dict[tuple[str, int, float], float] = field(default_factory=dict, repr=False)

    @staticmethod
    def of(
        rows: MlaRows | None,
        gpu: str,
        framework: str,
        m: ModelSpec,
        tp: int,
        fmt: str,
        hw: Hardware,
        pair_seconds: float,
    ) -> MlaTable:
        """``framework``: the engine whose rows these are; ``fmt``: the projections' format;
        ``hw``: the GPU the rows were timed on (the roofline beyond the last rows; the times apply
        as measured, as the GEMMs' do); ``pair_seconds``: the catalog's prefill attention per
        causal pair and layer (past the last prompt length)."""
        heads = m.num_heads // tp
        kv = get_precision(m.kv_dtype).name if m.kv_dtype else ("bf16" if m.dtype_bytes == 2 else "fp32")

        def outside(why: str) -> MlaTable:
            return MlaTable(heads, fmt, None, None, None, pair_seconds, kv, "", f"MLA block ({why})")

        if rows is None:
            return outside(f"no MLA module rows for {gpu}")
        if mla_shape(m) != TIMED_SHAPE:
            return outside(f"{m.name}'s MLA shapes are not DeepSeek-V3's, which the rows time")
        timed_kv = sorted({k[3] for k in rows.series})
        if kv not in timed_kv:
            return outside(f"{kv} KV cache: the rows time {' and '.join(timed_kv)} ones")
        table_fmt = TABLE_FORMATS.get(get_precision(fmt).name)
        if table_fmt is None:
            return outside(f"{fmt} projections: the rows time {', '.join(TABLE_FORMATS)}")
        if not any(k[1] == table_fmt and k[3] == kv for k in rows.series):
            return outside(f"{fmt} projections: no {table_fmt} rows with a {kv} KV cache for {gpu}")
        context = rows.series.get(("context", table_fmt, heads, kv))
        generation = rows.series.get(("generation", table_fmt, heads, kv))
        if context is None or generation is None or m.num_heads % tp:
            return outside(f"{m.num_heads / tp:g} heads per shard: not a head count the rows time")
        roof = ModuleRoofline.of(heads, fmt, hw, get_precision(kv).bytes)
        versions = rows.versions
        version = (
            versions["context"] if versions["context"] == versions["generation"]
            else f"{versions['context']} context, {versions['generation']} generation"
        )  # fmt: skip
        source = f"{ENGINES.get(framework, framework)} {version}"
        return MlaTable(heads, fmt, context, generation, roof, pair_seconds, kv, source)

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
            f"MLA block ({self.heads} heads per shard, {self.fmt} projections, {self.kv} KV) priced from "
            f"the MLA module rows of {self.source}"
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
        return grid_log_seconds(grid, self.roof, phase, batch, length)
