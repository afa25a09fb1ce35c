#!/bin/bash
# docs/experiments.md sections 1-5 with the current default cost model (fitted curves).
cd "$(dirname "$0")/../.."
T=../shared/traces/azure_llm_2023_conv.csv
O=${OUT:-docs/experiments}
EIGHT=sarathi:chunk_size=128,sarathi:chunk_size=256,sarathi:chunk_size=384,sarathi:chunk_size=512,sarathi:chunk_size=768,sarathi:chunk_size=1024,sarathi:chunk_size=1536,sarathi:chunk_size=2048
run() { name=$1; shift; echo "== $name $(date +%T) $(uptime)"; /usr/bin/time -f "$name %e s" nice -n 5 "$@" > $O/$name.txt 2>&1; tail -1 $O/$name.txt; }
run e1a tailserve tune --model Mistral-7B --hardware A100-80GB --trace $T --max-requests 2000 --policies sarathi --slo tbt_p99=100ms,queue_p50=2s --workers 2 --chunk-sizes 32,64,128,256,512,1024,2048,4096,8192 --request-rate 20 --json $O/e1a.json --out $O/e1a.jsonl
run e2a tailserve tune --model Mistral-7B --hardware A100-80GB --trace $T --max-requests 2000 --slo tbt_p99=100ms,queue_p50=2s --rel-tol 0.02 --workers 2 --policies $EIGHT --json $O/e2a.json --out $O/e2a.jsonl
run e3a tailserve tune --model Llama-3-8B --hardware H100-SXM --trace $T --max-requests 2000 --policies vllm --chunk-sizes 256,512,1024,2048,4096,8192,16384 --workers 2 --json $O/e3a.json --out $O/e3a.jsonl
run e3b tailserve tune --model Llama-3-8B --hardware H100-SXM --trace $T --max-requests 2000 --policies vllm --chunk-sizes 256,512,1024,2048,4096,8192,16384 --workers 2 --request-rate 10 --json $O/e3b.json --out $O/e3b.jsonl
run e3c tailserve tune --model Llama-3-8B --hardware H100-SXM --trace $T --max-requests 2000 --policies vllm --chunk-sizes 256,512,1024,2048,4096,8192,16384 --workers 2 --request-rate 40 --json $O/e3c.json --out $O/e3c.jsonl
run e4a tailserve compare --model Llama-2-13B --hardware A100-80GB --trace $T --rate-scale 0.25 --max-requests 2000 --workers 2 --policies vllm-v0:preemption_mode=swap:gpu_memory_utilization=0.5,vllm-v0:preemption_mode=recompute:gpu_memory_utilization=0.5,vllm:gpu_memory_utilization=0.5 --json $O/e4a.json
run e4b tailserve compare --model Llama-2-13B --hardware A100-80GB --trace $T --rate-scale 0.25 --max-requests 2000 --workers 2 --policies vllm-v0:preemption_mode=swap,vllm-v0:preemption_mode=recompute --json $O/e4b.json
run e4c tailserve cost --model Llama-2-13B --hardware A100-80GB --tp 1 --prefill 4000 --swap 4000
run e5a tailserve tune --model Yi-34B --hardware A100-80GB --tp 2 --trace $T --max-requests 2000 --policies sarathi,vllm-v0:max_num_seqs=128,vllm,orca --chunk-sizes 512 --slo tbt_p99=200ms,queue_p50=2s --rel-tol 0.02 --workers 2 --json $O/e5a.json --out $O/e5a.jsonl
run e5b tailserve tune --model Yi-34B --hardware A100-80GB --tp 2 --trace $T --max-requests 2000 --policies sarathi:chunk_size=2048,sarathi,vllm-v0:max_num_seqs=128,vllm,orca --chunk-sizes 2048 --slo tbt_p99=1s,queue_p50=2s --rel-tol 0.02 --workers 2 --json $O/e5b.json --out $O/e5b.jsonl
run e2b tailserve tune --model Llama-2-70B --hardware A100-80GB --tp 4 --trace $T --max-requests 2000 --slo tbt_p99=200ms,queue_p50=2s --rel-tol 0.02 --workers 2 --policies $EIGHT --json $O/e2b.json --out $O/e2b.jsonl
run e2c tailserve tune --model Llama-2-70B --hardware A100-80GB --tp 4 --trace $T --max-requests 2000 --slo tbt_p99=1s,queue_p50=2s --rel-tol 0.02 --workers 2 --policies $EIGHT --json $O/e2c.json --out $O/e2c.jsonl
run e1b tailserve tune --model Mistral-7B --hardware A100-80GB --trace $T --max-requests 2000 --policies sarathi --slo tbt_p99=100ms,queue_p50=2s --workers 2 --chunk-sizes 64,128,256,384,512,768,1024,1536,2048,4096,8192 --json $O/e1b.json --out $O/e1b.jsonl
run e5c tailserve tune --model Falcon-180B --hardware A100-80GB --tp 8 --trace $T --max-requests 2000 --policies sarathi,vllm-v0:max_num_seqs=128,orca --chunk-sizes 512 --slo tbt_p99=1s,queue_p50=2s --rel-tol 0.02 --workers 2 --json $O/e5c.json --out $O/e5c.jsonl
echo "== done $(date +%T) $(uptime)"
