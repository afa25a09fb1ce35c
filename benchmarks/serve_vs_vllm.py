"""tailserve's server against vLLM's CPU build, same model directory, same client, same workload.

1. ``tailserve serve`` on the model directory; ``tailserve bench`` against it, then ``vllm bench
   serve`` (vLLM's own client, from the vLLM virtual environment) against it, to show a foreign
   client works unmodified.
2. vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, ``VLLM_CPU_KVCACHE_SPACE``)
   on the same directory; the same ``tailserve bench`` workload against it.

Each server is started fresh, warmed up with a few requests of another seed (so no prompt of the
measured run is in a prefix cache), measured once and stopped. The workload is
peer-engines-cpu.md's W by default: 64 random prompts of 256 token ids, 64 new tokens each with
``ignore_eos``, all sent at once. Before each measurement the script waits for a quiet machine
and records the whole machine's busy CPU-seconds during the run beside the server's and the
client's own. Throughput, p50/p99 TTFT and ITL side by side go to the terminal and to
``benchmarks/out/serve_vs_vllm.json`` (git-ignored; the committed figures are
``--out benchmarks/results/serve_vs_vllm.json``).

    python -m benchmarks.serve_vs_vllm [--model DIR] [--vllm-venv DIR] [--num-prompts 64]

vLLM lives in its own virtual environment, by default ``${TAILSERVE_PEERS:-<repo>/.peers}/vllm``
as ``scripts/setup-peers.sh vllm`` makes it (the script says so when it is missing).
``--skip-vllm`` measures tailserve alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import cpu_line, default_out, missing_peer, peer_venv, simd_flags

HERE = Path(__file__).resolve().parent
# vLLM's `vllm` command fails in the vllm-cpu distribution (no package metadata named "vllm"):
# run its benchmark module directly.
VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)
SUMMARY_KEYS = (
    "completed", "failed", "duration", "request_throughput", "output_throughput",
    "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms",
)  # fmt: skip


# ---- the machine --------------------------------------------------------------------------------
def busy_cpu_seconds() -> float:
    """CPU-seconds every core of the machine spent busy since boot (/proc/stat)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU-seconds of a process and all its descendants (vLLM runs its engine in a child)."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        rest = stat.rsplit(")", 1)[1].split()
        ppid, utime, stime = int(rest[1]), float(rest[11]), float(rest[12])
        children.setdefault(ppid, []).append(int(entry.name))
        times[int(entry.name)] = (utime + stime) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += children.get(p, [])
    return total


def wait_quiet(threshold: float, timeout: float) -> bool:
    """Wait until the machine's busy CPU stays below ``threshold`` cores for 3 s; False on timeout."""
    deadline = time.monotonic() + timeout
    quiet_since = None
    last = busy_cpu_seconds()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = busy_cpu_seconds()
        busy, last = now - last, now
        quiet_since = (quiet_since or time.monotonic()) if busy < threshold else None
        if quiet_since is not None and time.monotonic() - quiet_since >= 3.0:
            return True
    return False


# ---- servers ----------------------------------------------------------------------------------------
def start_server(
    cmd: list[str], env: dict[str, str], url: str, timeout: float, log: Path
) -> subprocess.Popen:
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; its log: {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer {url}/health within {timeout:.0f} s; its log: {log}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- clients -----------------------------------------------------------------------------------------
def tailserve_bench(url: str, args: argparse.Namespace, seed: int, num_prompts: int, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "tailserve.cli", "bench", "--base-url", url, "--model", args.name]
    cmd += ["--tokenizer", str(args.model), "--dataset", "random", "--num-prompts", str(num_prompts)]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--request-rate", str(args.request_rate), "--seed", str(seed), "--temperature", "0"]
    cmd += ["--metric-percentiles", "50,99", "--json", str(out), "--no-progress"]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    return cmd


def vllm_bench(url: str, args: argparse.Namespace, seed: int, out: Path) -> list[str]:
    cmd = [str(Path(args.vllm_venv) / "bin" / "python"), "-c", VLLM_BENCH, "--base-url", url]
    cmd += ["--model", args.name, "--tokenizer", str(args.model), "--dataset-name", "random"]
    cmd += ["--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--request-rate", str(args.request_rate)]
    cmd += ["--seed", str(seed), "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    cmd += ["--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-filename", str(out)]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    return cmd


def measure(
    label: str, cmd: list[str], server: subprocess.Popen, out: Path, args: argparse.Namespace
) -> dict:
    quiet = wait_quiet(args.quiet_threshold, args.quiet_timeout)
    machine0, server0 = busy_cpu_seconds(), tree_cpu_seconds(server.pid)
    client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True)
    client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine = busy_cpu_seconds() - machine0
    server_cpu = tree_cpu_seconds(server.pid) - server0
    client_cpu = (client1.ru_utime + client1.ru_stime) - (client0.ru_utime + client0.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"{label}: the client failed ({done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    row = {"run": label, **{k: result.get(k) for k in SUMMARY_KEYS}}
    row["cpu_s"] = {
        "machine": round(machine, 2),
        "server": round(server_cpu, 2),
        "client": round(client_cpu, 2),
        "other": round(machine - server_cpu - client_cpu, 2),
        "quiet_before": quiet,
    }
    print(
        f"{label}: {row['output_throughput']:.0f} output tok/s, TTFT p50 {row['median_ttft_ms']:.0f} ms",
        flush=True,
    )
    return row


# ---- main ----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: tailserve's tiny model)")
    p.add_argument("--name", default="tiny", help="served model name for both servers")
    p.add_argument(
        "--vllm-venv",
        default=str(peer_venv("vllm")),
        help="virtual environment with vllm-cpu (default: $TAILSERVE_PEERS/vllm, else <repo>/.peers/vllm)",
    )
    p.add_argument("--skip-vllm", action="store_true", help="measure tailserve only")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", default="inf", help="requests/s (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8011, help="tailserve's port; vLLM's is the next one")
    p.add_argument("--vllm-kvcache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE (default: %(default)s)")
    p.add_argument("--vllm-omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's auto)")
    p.add_argument("--quiet-threshold", type=float, default=0.3, help="busy cores that count as quiet")
    p.add_argument("--quiet-timeout", type=float, default=600.0, help="seconds to wait for a quiet machine")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds a server may take to start")
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/out/serve_vs_vllm.json)")
    args = p.parse_args()
    args.out = args.out or str(default_out("serve_vs_vllm.json"))
    return args


def main() -> int:
    args = parse_args()
    if args.model is None:
        from tailserve.executors.pytorch.init_model import default_model_dir

        args.model = default_model_dir()
    args.model = Path(args.model).resolve()
    vllm_python = Path(args.vllm_venv) / "bin" / "python"
    if not args.skip_vllm:
        check = (
            subprocess.run([str(vllm_python), "-c", "import vllm"], capture_output=True)
            if vllm_python.exists()
            else None
        )
        if check is None or check.returncode != 0:
            print(
                f"serve_vs_vllm: error: {missing_peer('vllm', args.vllm_venv)} Or run with --skip-vllm.",
                file=sys.stderr,
            )
            return 2
    work = Path(tempfile.mkdtemp(prefix="serve_vs_vllm-"))
    rows: list[dict[str, Any]] = []
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    url = f"http://127.0.0.1:{args.port}"
    cmd = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "serve",
        "--model",
        str(args.model),
        "--port",
        str(args.port),
    ]
    cmd += [
        "--served-model-name",
        args.name,
        "--max-model-len",
        str(args.max_model_len),
        "--log-level",
        "warning",
    ]
    server = start_server(cmd, base_env, url, args.server_timeout, work / "tailserve.log")
    try:
        subprocess.run(
            tailserve_bench(url, args, args.seed + 1000, args.warmup_prompts, work / "warm.json"),
            check=True,
            capture_output=True,
        )
        rows.append(
            measure(
                "tailserve + tailserve bench",
                tailserve_bench(url, args, args.seed, args.num_prompts, work / "t.json"),
                server,
                work / "t.json",
                args,
            )
        )
        if not args.skip_vllm:
            rows.append(
                measure(
                    "tailserve + vllm bench serve",
                    vllm_bench(url, args, args.seed + 1, work / "tv.json"),
                    server,
                    work / "tv.json",
                    args,
                )
            )
    finally:
        stop_server(server)

    if not args.skip_vllm:
        url = f"http://127.0.0.1:{args.port + 1}"
        env = {**base_env, "VLLM_CPU_KVCACHE_SPACE": args.vllm_kvcache_gib}
        if args.vllm_omp_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
        cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model)]
        cmd += ["--served-model-name", args.name, "--host", "127.0.0.1", "--port", str(args.port + 1)]
        cmd += ["--dtype", "bfloat16", "--max-model-len", str(args.max_model_len)]
        server = start_server(cmd, env, url, args.server_timeout, work / "vllm.log")
        try:
            subprocess.run(
                tailserve_bench(url, args, args.seed + 1000, args.warmup_prompts, work / "warm.json"),
                check=True,
                capture_output=True,
            )
            rows.append(
                measure(
                    "vLLM + tailserve bench",
                    tailserve_bench(url, args, args.seed, args.num_prompts, work / "v.json"),
                    server,
                    work / "v.json",
                    args,
                )
            )
        finally:
            stop_server(server)

    print_table(rows)
    payload = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "workload": {
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "seed": args.seed,
            "ignore_eos": True, "temperature": 0,
        },
        "model": str(args.model),
        "vllm": None if args.skip_vllm else {
            "venv": args.vllm_venv, "VLLM_CPU_KVCACHE_SPACE": args.vllm_kvcache_gib,
            "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_bind or "auto (default)",
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "runs": rows,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    print(cpu_line())
    Path(args.out).write_text(json.dumps({**payload, "cpu_flags": simd_flags()}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'run':<30} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'other CPU-s':>11}"
    print(head)
    for r in rows:
        print(
            f"{r['run']:<30} {r['request_throughput']:>7.2f} {r['output_throughput']:>10.0f} "
            f"{r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>9.1f} {r['median_itl_ms']:>8.1f} "
            f"{r['p99_itl_ms']:>8.1f} {r['cpu_s']['other']:>11.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
