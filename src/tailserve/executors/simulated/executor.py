"""``SimExecutor``: the cost model behind the executor contract, in virtual time."""

from __future__ import annotations

import numpy as np

from tailserve.core.executor import StepResult, step_result
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.cuda_graph import CudaGraphPadding, is_generation_only
from tailserve.executors.simulated.layerwise_load import layerwise_load_time
from tailserve.executors.simulated.spec_decode import DrafterCost, SpecDecoding, accepted_drafts
from tailserve.executors.simulated.window import WindowShape


def batch_shape(out: SchedulerOutput) -> BatchShape:
    """The cost model's view of one iteration (``batch_fields``)."""
    return BatchShape(*batch_fields(out))


def batch_fields(out: SchedulerOutput) -> tuple[int, int, int, int, int, int, int]:
    """``BatchShape``'s fields of one iteration, in its order. Padding slots of a static batch compute (and
    sample) like real ones; a scheduled request samples when its chunk reaches its last token.
    A speculative verification (SGLang's drafts: ``num_spec_tokens``) is priced as
    ``advanced_batch_shape`` prices one: a small chunk with logits at each position, counted
    neither as a prefill nor as a one-token decode."""
    # One pass over the scheduled requests (this runs once per stepped iteration; integer sums,
    # so the order of the terms cannot change them).
    # The one-token decodes first and with the fewest operations (most of every batch): their
    # tokens and ``+ 1``s are added once, after the loop.
    num_tokens = num_logits = pairs = prefill_kv = decode_kv = num_decodes = num_verifies = 0
    spec_tokens = 0
    scheduled = out.scheduled
    head = out.decode_head
    if head is not None:
        # The policy counted its leading decodes as it built them (each samples): the pass
        # takes the rest, the prompts' chunks as a rule.
        num_decodes, decode_kv = head
        num_logits = num_decodes
        scheduled = scheduled[num_decodes:]
    for s in scheduled:
        q = s.num_new_tokens
        if q == 1 and not s.num_spec_tokens:
            c = s.num_context_tokens
            decode_kv += c
            num_decodes += 1
            r = s.request
            if c + 1 == r.prompt_len + r.num_output_tokens:  # ``num_tokens``, inlined: it samples
                num_logits += 1
            continue
        c = s.num_context_tokens
        num_tokens += q
        if s.num_spec_tokens:
            num_logits += q
            pairs += q * c + q * (q + 1) // 2
            prefill_kv += q + c
            num_verifies += 1
            spec_tokens += q
            continue
        r = s.request
        if c + q == r.prompt_len + r.num_output_tokens:
            num_logits += 1
        pairs += q * c + q * (q + 1) // 2
        prefill_kv += q + c
    # ``out.token_counts()`` from this pass (the engine logs it after the step): chunks of more
    # than one token are prefill (a chunk of none adds nothing), the rest decode.
    out.counted_tokens = (num_tokens - spec_tokens, num_decodes + spec_tokens)
    num_tokens += num_decodes
    decode_kv += num_decodes
    num_prefills = len(out.scheduled) - num_decodes - num_verifies
    if out.padding:  # static batching only: every padding slot samples, as BatchShape.of counts
        pad = BatchShape.of(
            [(p.num_new_tokens, p.num_context_tokens) for p in out.padding if p.num_new_tokens != 1],
            [p.num_context_tokens for p in out.padding if p.num_new_tokens == 1],
        )
        num_tokens += pad.num_tokens
        num_logits += pad.num_logits
        pairs += pad.prefill_pairs
        prefill_kv += pad.prefill_kv_tokens
        decode_kv += pad.decode_kv_tokens
        num_prefills += pad.num_prefills
        num_decodes += pad.num_decodes
    return num_tokens, num_logits, pairs, prefill_kv, decode_kv, num_prefills, num_decodes


def advanced_batch_shape(out: SchedulerOutput) -> BatchShape:
    """``batch_shape`` of an ``advanced`` output (vLLM's accounting: async scheduling,
    speculative decoding), whose requests say themselves whether they sample (``partial``). A
    speculative decode verifying 1 + s tokens is priced like a small prefill chunk after its
    context (more tokens, the same KV read), with logits at each of its 1 + s positions; it is
    counted neither as a prefill chunk nor as a one-token decode (``BatchShape``'s counts: vLLM's
    MLA backends run it through the decode kernel, not the prefill one)."""
    return BatchShape(*advanced_batch_fields(out))


def advanced_batch_fields(out: SchedulerOutput) -> tuple[int, int, int, int, int, int, int]:
    """``advanced_batch_shape``'s fields, in ``BatchShape``'s order."""
    num_tokens = num_logits = pairs = prefill_kv = decode_kv = num_prefills = num_decodes = 0
    spec_tokens = 0  # tokens of verifications longer than one token
    scheduled = out.scheduled
    head = out.decode_head
    if head is not None:
        # The policy counted its leading plain decodes as it built them (vLLM's async pass:
        # one token each, each samples): the pass takes the rest, which most steps lack.
        num_decodes, context = head
        num_tokens = num_logits = num_decodes
        decode_kv = context + num_decodes
        scheduled = scheduled[num_decodes:]
    for s in scheduled:
        q, c = s.num_new_tokens, s.num_context_tokens
        num_tokens += q
        if not s.partial:
            num_logits += 1 + s.num_spec_tokens
        if q == 1:
            decode_kv += c + 1
            num_decodes += 1
        else:
            pairs += q * c + q * (q + 1) // 2
            prefill_kv += q + c
            if s.num_spec_tokens:
                spec_tokens += q
            else:
                num_prefills += 1
    # ``out.token_counts()`` from this pass, as ``batch_fields`` leaves it: the engine logs it
    # after every step, which was a second pass over the batch (chunks of more than one token
    # without drafts are prefill, the rest decode; integer sums).
    out.counted_tokens = (num_tokens - num_decodes - spec_tokens, num_decodes + spec_tokens)
    return num_tokens, num_logits, pairs, prefill_kv, decode_kv, num_prefills, num_decodes


def window_shape(out: SchedulerOutput, window: int) -> WindowShape:
    """``batch_shape``'s attention aggregates for sliding-window layers (window.py)."""
    prefill: list[tuple[int, int]] = []
    decodes: list[int] = []
    for q, c in [(s.num_new_tokens, s.num_context_tokens) for s in out.scheduled] + [
        (p.num_new_tokens, p.num_context_tokens) for p in out.padding
    ]:
        if q == 1:
            decodes.append(c)
        else:
            prefill.append((q, c))
    return WindowShape.of(prefill, decodes, window)


class SimExecutor:
    """Predicts each iteration's duration; produces no token ids (outputs run to ``max_tokens``).
    With speculative decoding (``spec``) it also draws how many drafts each verification
    accepts (``spec_decode.accepted_drafts``, seeded by ``seed``) and adds the drafter's time."""

    needs_block_ids = False  # the cost model prices batch shapes, not blocks

    def __init__(
        self,
        cost_model: CostModel,
        block_size: int = 16,
        spec: SpecDecoding | None = None,
        seed: int = 0,
        graph: CudaGraphPadding | None = None,
    ) -> None:
        self.cost_model = cost_model
        self.block_size = block_size  # tokens per KV block, to price swap traffic
        self.spec = spec
        self.seed = seed
        # TensorRT-LLM's CUDA-graph padding of generation-only steps (cuda_graph.py); None: off
        self.graph = graph
        self.drafter = DrafterCost(cost_model, spec) if spec is not None else None
        # A sliding-window model's attention depends on each request's context, not on the
        # batch's sums alone: the exact fast paths (which price sums) stay off for it.
        self.prices_shapes_alone = not cost_model.windowed
        # No CUDA-graph padding, drafts or window: a step is its batch's sums alone.
        self._plain = graph is None and spec is None and not cost_model.windowed

    def execute(self, out: SchedulerOutput) -> StepResult:
        if out.advanced:
            return self._execute_advanced(out)
        cm = self.cost_model
        if self._plain:
            # Priced from the fields (``shape_time``: ``iteration_time`` without a window)
            # without building the frozen ``BatchShape`` (~2,500 instructions, once per stepped
            # iteration).
            fields = batch_fields(out)
            duration = cm.shape_time(*fields)
            num_tokens, num_logits = fields[0], fields[1]
        else:
            window = window_shape(out, cm.model.sliding_window) if cm.windowed else None
            shape = batch_shape(out)
            if self.graph is not None and not out.padding and is_generation_only(out):
                shape = self.graph.pad(shape, len(out.scheduled))
            duration = cm.iteration_time(shape, window)
            num_tokens, num_logits = shape.num_tokens, shape.num_logits
        # The lists tested first: the two counts are properties (a call through C each, ~900
        # instructions), read only when some block moves.
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            # vLLM V0 issues the block copies before the forward pass, which waits for them.
            duration += cm.swap_time((out.num_swap_out_blocks + out.num_swap_in_blocks) * self.block_size)
        if out.kv_copy_time:  # the host copies the policy priced (TensorRT-LLM's host pool)
            duration += out.kv_copy_time
        if out.host_load_seconds:  # SGLang's HiCache load-backs, overlapped layer by layer
            duration = layerwise_load_time(duration, out.host_load_seconds, cm.model.num_layers)
        if self.spec is not None:  # SGLang's speculative decoding (vLLM's runs ``advanced``)
            return self._execute_drafts(out, shape, duration)
        if cm.pipeline is not None:
            # Sarathi-Serve's pipelined engine (policies/sarathi_pipeline.py): the per-step
            # overhead is the host part before stage 1, the forward pass split over the stages.
            result = step_result(duration)
            result.host_time = self._host_time(num_tokens)
            return self._on_stages(result, num_tokens, num_logits)
        return step_result(duration)

    def _execute_drafts(self, out: SchedulerOutput, shape: BatchShape, duration: float) -> StepResult:
        """A step with chain drafts outside vLLM's accounting (SGLang, TensorRT-LLM): the
        target's ``duration``, then ``drafts``'."""
        drafting, accepted = self.drafts(out, shape)
        return StepResult(duration=duration + drafting, num_accepted=accepted)

    def drafts(
        self, out: SchedulerOutput, shape: BatchShape, num_padded: int = 0
    ) -> tuple[float, dict[str, int]]:
        """The drafter's time in a step of ``shape`` and the drafts each verification accepts
        (``accepted_drafts``). The drafter runs over the step's tokens (its extend pass) and then
        drafts for every request that sampled — verified, or finished its prompt — and for the
        ``num_padded`` dummy requests of a padded CUDA graph. Outside vLLM's accounting (SGLang,
        TensorRT-LLM) a request that finished its prompt is told by its tokens; in it
        (``advanced``) by ``partial``, and a new request's padding drafts are never accepted.
        The lockstep DP group (cluster/dp_group.py) calls it per rank."""
        spec, drafter = self.spec, self.drafter
        assert spec is not None and drafter is not None
        accepted: dict[str, int] = {}
        num_drafting = drafting_kv = 0
        if out.advanced:
            for s in out.scheduled:
                if s.partial:
                    continue
                num_drafting += 1
                drafting_kv += s.num_context_tokens + s.num_new_tokens
                if s.num_spec_tokens and not s.spec_padding:
                    rid = s.request.request_id
                    accepted[rid] = accepted_drafts(spec, self.seed, rid, s.num_context_tokens)
        else:
            for s in out.scheduled:
                r = s.request
                c, q = s.num_context_tokens, s.num_new_tokens
                if s.num_spec_tokens:
                    rid = r.request_id
                    accepted[rid] = accepted_drafts(spec, self.seed, rid, c)
                elif c + q != r.prompt_len + r.num_output_tokens:
                    continue  # a partial prefill chunk samples nothing, so drafts nothing
                num_drafting += 1
                drafting_kv += c + q
        return drafter.time(shape, num_drafting + num_padded, drafting_kv), accepted

    def _execute_advanced(self, out: SchedulerOutput) -> StepResult:
        """A step of vLLM's own accounting: the target's time, the drafter's and the drafts
        accepted; the per-step overhead is the host time async scheduling hides. Under pipeline
        parallelism, the forward pass's time on each stage (``CostModel.pipeline_split``)."""
        cost = self.cost_model
        if self._plain:
            # No CUDA-graph padding, drafts or window: priced from the fields (``shape_time``)
            # and returned without the class calls, as ``execute`` does a plain step: the frozen
            # ``BatchShape`` (~2,500 instructions) and the ``StepResult`` (~4,000,
            # ``step_result``) were made for every async step.
            fields = advanced_batch_fields(out)
            duration = cost.shape_time(*fields)
            if out.host_load_seconds:  # SGLang's HiCache load-backs, overlapped layer by layer
                duration = layerwise_load_time(duration, out.host_load_seconds, cost.model.num_layers)
            result = step_result(duration)
            result.host_time = self._host_time(fields[0])
            if out.kv_copy_time:
                self._add_copy_time(result, out.kv_copy_time)
            if cost.pipeline is not None:
                self._on_stages(result, fields[0], fields[1])
            return result
        shape = advanced_batch_shape(out)
        num_padded = 0  # dummy requests of a padded CUDA graph, which draft too
        if self.graph is not None and is_generation_only(out):
            n = len(out.scheduled)
            size = self.graph.padded_batch(n)
            shape = self.graph.pad(shape, n, size)
            num_padded = size - n
        window = window_shape(out, cost.model.sliding_window) if cost.windowed else None
        duration = cost.iteration_time(shape, window)
        if out.host_load_seconds:
            duration = layerwise_load_time(duration, out.host_load_seconds, cost.model.num_layers)
        accepted: dict[str, int] | None = None
        drafting = 0.0
        if self.spec is not None:
            drafting, accepted = self.drafts(out, shape, num_padded)
            duration += drafting
        result = StepResult(
            duration=duration, num_accepted=accepted, host_time=self._host_time(shape.num_tokens)
        )
        if out.kv_copy_time:
            self._add_copy_time(result, out.kv_copy_time)
        if cost.pipeline is not None:
            # vLLM builds the drafter on the last PP rank only (v1/worker/gpu/model_runner.py:294-298@v0.32.0)
            self._on_stages(result, shape.num_tokens, shape.num_logits, drafting)
        return result

    def _on_stages(
        self, result: StepResult, num_tokens: int, num_logits: int, last_stage: float = 0.0
    ) -> StepResult:
        """Under pipeline parallelism: the step's forward pass (its duration past the host part,
        host copies included in both) on each stage, ``last_stage`` seconds of it (the drafter)
        on the last, and the send between two (``CostModel.pipeline_split``)."""
        stages, result.stage_send = self.cost_model.pipeline_split(
            result.duration - result.host_time - last_stage, num_tokens, num_logits
        )
        if last_stage:
            stages = (*stages[:-1], stages[-1] + last_stage)
        result.stages = stages
        return result

    @staticmethod
    def _add_copy_time(result: StepResult, copy_time: float) -> None:
        """Host copies issued with an advanced step (TensorRT-LLM's overlap scheduler issues
        them in ``prepare_resources``, on their own streams): they run while the previous
        step's forward pass does, as the host part does, and the step's kernels wait for them.
        Counted after the host part (the copies are issued at its end)."""
        result.duration += copy_time
        result.host_time += copy_time

    def _host_time(self, num_tokens: int) -> float:
        """``host_time`` of a step of ``num_tokens`` tokens: the per-step overhead, which async
        scheduling runs during the previous step's forward pass and a pipelined engine before
        stage 1 (none for an empty step)."""
        return self.cost_model.efficiency.overhead if num_tokens else 0.0

    def decode_host_time(self, num_decodes: int) -> float:
        """``host_time`` of an advanced decode-only step (``_execute_advanced``)."""
        return self._host_time(num_decodes)

    def _padded(self, num_decodes: int) -> int:
        """The batch a decode-only step runs at (``num_decodes`` without CUDA-graph padding)."""
        return num_decodes if self.graph is None else self.graph.padded_batch(num_decodes)

    def decode_step_duration(self, num_decodes: int, num_context_tokens: int) -> float:
        n = self._padded(num_decodes)
        return self.cost_model._iteration_time(n, n, 0, 0, num_context_tokens, 0, n)

    def decode_step_durations(self, num_decodes: int, num_context_tokens: int, num_steps: int) -> list[float]:
        if self._padded(num_decodes) != num_decodes:
            return self.decode_run_durations(num_decodes, num_context_tokens, num_steps).tolist()
        return self.cost_model.decode_step_times(num_decodes, num_context_tokens, num_steps)

    def decode_run_durations(self, num_decodes: int, num_context_tokens: int, num_steps: int) -> np.ndarray:
        n = self._padded(num_decodes)
        if n == num_decodes:
            return self.cost_model.decode_run_times(num_decodes, num_context_tokens, num_steps)
        # The GEMMs over the padded batch, the attention over the real requests' KV (cuda_graph.py).
        decode_kv = num_context_tokens + num_decodes * np.arange(num_steps, dtype=np.int64)
        return self.cost_model._iteration_time(n, n, 0, 0, decode_kv, 0, n)
