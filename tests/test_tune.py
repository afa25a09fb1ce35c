"""``tailserve tune``: ranked capacities, the budget sweep's flat region, flags that parse, and
clear errors."""

from __future__ import annotations

import json
import math
import re
import shlex

import pytest

from tailserve.cli import main
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.policies.registry import PolicySpec, parse_policy_list
from tailserve.tune.capacity import Capacity
from tailserve.tune.recommend import PolicyTune, SizePoint, _choose, _with_size, command_line
from tailserve.workloads.lengths import parse_length

TUNE = [
    "tune", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--workload", "random",
    "--num-requests", "80", "--input-len", "lognormal:mean=1500,sigma=1,max=7000", "--output-len", "64",
    "--rate", "8", "--slo", "ttft_p99=1s,tbt_p99=50ms", "--chunk-sizes", "256,512,1024,2048,4096",
    "--workers", "1", "--quiet",
]  # fmt: skip


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    out, runs = tmp / "tune.json", tmp / "runs.jsonl"
    args = [*TUNE, "--policies", "vllm,sglang,tgi", "--json", str(out), "--out", str(runs)]
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(args)
    assert code == 0, stderr.getvalue()
    return {"args": args, "json": json.loads(out.read_text()), "out": stdout.getvalue(), "err": stderr.getvalue(),
            "runs": runs}  # fmt: skip


def test_policies_are_ranked_by_capacity(tuned):
    policies = tuned["json"]["policies"]
    capacities = [p["capacity_req_s"] for p in policies]
    assert capacities == sorted(capacities, reverse=True)
    assert capacities[0] > 0
    for p in policies:
        met = {run["rate"]: run["meets_slo"] for run in p["capacity_runs"]}
        assert met[p["capacity_req_s"]] is True and met[p["capacity_upper_req_s"]] is False
    # the budget sweep runs at the best policy's capacity unless --request-rate says otherwise
    assert tuned["json"]["sweep_rate"] == pytest.approx(capacities[0])


def test_recommended_size_is_the_optimum_inside_its_flat_region(tuned):
    for p in tuned["json"]["policies"]:
        key = {
            s["size"]: (s["num_turned_away"], s["slo_ratio"])
            for s in p["sweep"]
            if s["slo_ratio"] is not None
        }
        best = key[p["best_size"]]
        assert best == min(key.values())
        lo, hi = p["flat_region"]
        assert lo <= p["best_size"] <= hi
        for size, (away, ratio) in key.items():
            if lo <= size <= hi:
                assert away == best[0] and ratio <= best[1] * 1.1 + 1e-12


def test_printed_flags_parse(tuned):
    out, policies = tuned["out"], {p["policy"]: p for p in tuned["json"]["policies"]}
    vllm = re.search(r"^\s*vllm serve (\S+) (.*)$", out, re.M)
    assert vllm, out
    assert vllm.group(1) == "meta-llama/Meta-Llama-3-8B"
    argv = shlex.split(vllm.group(2))
    budget = int(argv[argv.index("--max-num-batched-tokens") + 1])
    seqs = int(argv[argv.index("--max-num-seqs") + 1])
    assert budget == policies["vllm"]["best_size"] and seqs <= budget
    sglang = re.search(
        r"python -m sglang.launch_server .*--chunked-prefill-size (\d+) --schedule-policy fcfs", out
    )
    assert sglang and int(sglang.group(1)) == policies["sglang"]["best_size"]
    tgi = re.search(r"text-generation-launcher .*--max-batch-prefill-tokens (\d+) --waiting-served-ratio ([\d.]+) "
                    r"--max-waiting-tokens (\d+)", out)  # fmt: skip
    assert tgi and int(tgi.group(1)) == policies["tgi"]["best_size"]
    assert (float(tgi.group(2)), int(tgi.group(3))) == (0.3, 20)


def test_a_second_tune_reuses_every_run(tuned, capsys):
    lines = len(tuned["runs"].read_text().splitlines())
    assert f"{lines} simulated, 0 reused" in tuned["err"]
    assert main(tuned["args"]) == 0
    assert f"0 simulated, {lines} reused" in capsys.readouterr().err


def test_every_capacity_is_replayed_with_twice_the_requests(tuned):
    from tailserve.sim.workload_spec import WorkloadSpec
    from tailserve.tune.capacity import CapacitySlo, RateScaler, parse_capacity_slo
    from tailserve.tune.sweep import RunSpec, Sweep, make_backend

    slo: CapacitySlo = parse_capacity_slo("ttft_p99=1s,tbt_p99=50ms")
    policies = tuned["json"]["policies"]
    checked = [p for p in policies if p["capacity_req_s"] > 0]
    assert checked
    lengths = parse_length("lognormal:mean=1500,sigma=1,max=7000")
    longer = WorkloadSpec(
        "random", num_requests=160, rate=8, input_len=lengths, output_len=parse_length("64")
    )
    with Sweep(make_backend(1), quiet=True) as sweep:
        for p in checked:
            assert p["longer_workload"] == "160 requests"
            spec = RunSpec(
                Deployment.of("Llama-3-8B", "H100-SXM", 1), longer, parse_policy_list(p["policy"])[0]
            )
            (outcome,) = sweep.run([RateScaler.of(spec).at(p["capacity_req_s"])])
            assert p["holds_on_longer"] is slo.meets(outcome.summary)
            assert p["longer_slo_ratio"] == pytest.approx(slo.ratio(outcome.summary))
            # The printed warning names exactly the capacities that did not hold.
            flat = " ".join(tuned["out"].split())  # rich wraps long lines
            warned = re.search(rf"! {re.escape(p['policy'])}: its capacity \(.*? misses the SLO", flat)
            assert bool(warned) is (not p["holds_on_longer"])
    if any(not p["holds_on_longer"] for p in checked):
        assert "--num-requests 160 or more" in " ".join(tuned["out"].split())  # rich wraps lines


def test_the_throughput_ceiling_is_printed_with_every_capacity_above_it(tuned):
    ceiling = tuned["json"]["throughput_ceiling"]
    assert 0 < ceiling["req_s"] <= ceiling["upper_req_s"]
    assert ceiling["policy"].startswith("vllm:max_num_batched_tokens=")
    flat = " ".join(tuned["out"].split())  # rich wraps long lines
    best = max(p["capacity_req_s"] for p in tuned["json"]["policies"])
    assert f"throughput ceiling {ceiling['req_s']:.3g}-{ceiling['upper_req_s']:.3g} req/s" in flat
    share = f"{best / ceiling['upper_req_s']:.0%}-{best / ceiling['req_s']:.0%}"
    assert f"The best capacity is {share} of it." in flat
    for p in tuned["json"]["policies"]:
        above = re.search(
            rf"! {re.escape(p['policy'])}: its capacity \([^)]*\) is above the throughput ceiling", flat
        )
        assert bool(above) is (p["capacity_req_s"] > ceiling["upper_req_s"])


def test_the_longer_workload_doubles_what_sets_its_size(tmp_path):
    from tailserve.sim.workload_spec import WorkloadSpec
    from tailserve.tune.capacity import longer_workload, workload_size

    chat = WorkloadSpec("chat", num_requests=300)
    assert (
        longer_workload(chat).num_requests == 600 and workload_size(longer_workload(chat)) == "600 requests"
    )
    turns = WorkloadSpec("multi-turn", num_sessions=40)
    assert longer_workload(turns).num_sessions == 80
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"arrival_time": i * 0.5, "prompt_len": 100, "max_tokens": 10}) + "\n"
            for i in range(30)
        )
    )
    part = WorkloadSpec("trace", trace_path=str(trace), max_requests=10)
    assert longer_workload(part).max_requests == 20
    assert longer_workload(WorkloadSpec("trace", trace_path=str(trace), max_requests=20)).max_requests == 30
    assert longer_workload(WorkloadSpec("trace", trace_path=str(trace), max_requests=30)) is None
    assert longer_workload(WorkloadSpec("trace", trace_path=str(trace))) is None  # the whole trace


def test_flat_region_is_the_contiguous_run_near_the_optimum():
    pt = PolicyTune(PolicySpec("vllm"), Capacity(1.0, 2.0), "max_num_batched_tokens", 2048)
    ratios = [5.0, 1.05, 1.0, 1.08, 3.0, 1.01]  # the last one is near the optimum but not adjacent
    pt.points = [
        SizePoint(2**i * 128, PolicySpec("vllm"), r, {"num_turned_away": 0}) for i, r in enumerate(ratios)
    ]
    _choose(pt, 0.10)
    assert pt.best.size == 512 and pt.flat == (256, 1024) and pt.flat_sizes == [256, 512, 1024]
    _choose(pt, 0.0)
    assert pt.flat == (512, 512)


def test_fewer_turned_away_beats_a_lower_ratio():
    pt = PolicyTune(PolicySpec("tgi"), Capacity(1.0, 2.0), "max_batch_prefill_tokens", 4096)
    pt.points = [
        SizePoint(512, PolicySpec("tgi"), 0.2, {"num_turned_away": 9}),
        SizePoint(1024, PolicySpec("tgi"), 0.9, {"num_turned_away": 0}),
        SizePoint(2048, PolicySpec("tgi"), math.inf, error="invalid"),
    ]
    _choose(pt, 0.5)
    assert pt.best.size == 1024 and pt.flat == (1024, 1024) and pt.best.meets


def test_small_budgets_bring_what_the_engine_requires():
    device = get_hardware("A100-80GB").device_info
    v1 = _with_size(PolicySpec("vllm"), "max_num_batched_tokens", 128, device, 8192)
    assert v1.flags == {"max_num_batched_tokens": 128, "max_num_seqs": 128}
    v0 = _with_size(PolicySpec("vllm-v0"), "max_num_batched_tokens", 2048, device, 8192)
    assert v0.flags["enable_chunked_prefill"] is True
    v0_whole = _with_size(PolicySpec("vllm-v0"), "max_num_batched_tokens", 8192, device, 8192)
    assert "enable_chunked_prefill" not in v0_whole.flags
    line = command_line(v0, Deployment(), None, device, 8192)
    assert line.startswith("VLLM_USE_V1=0 vllm serve meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4")
    assert "--enable-chunked-prefill" in line and "--max-num-batched-tokens 2048" in line
    priority = PolicySpec.make("vllm", {"scheduling_policy": "priority", "max_num_batched_tokens": 512})
    assert command_line(priority, Deployment(), "my/model", device, 8192).endswith(
        "--max-num-batched-tokens 512 --max-num-seqs 256 --scheduling-policy priority"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--slo", "ttft_p99=soon"], "--slo item 'ttft_p99=soon'"),
        (["--slo", "p99=2s"], "METRIC_STAT=TIME"),
        (["--policies", "vllm,fastest"], "unknown policy 'fastest'"),
        (["--chunk-sizes", "512,big"], "--chunk-sizes"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--workload", "hol"], "hol workload"),
    ],
)
def test_bad_input_is_one_clear_line(extra, message, tmp_path, capsys):
    assert main([*TUNE, "--out", str(tmp_path / "r.jsonl"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailserve: error: ") and message in err
    assert "Traceback" not in err


def test_report_writes_the_page_with_sweep_curves(tmp_path, capsys):
    pytest.importorskip("tailserve.report.html")
    report = tmp_path / "report"
    args = [*TUNE, "--policies", "vllm", "--chunk-sizes", "512,2048", "--report", str(report)]
    assert main(args) == 0
    assert "report:" in capsys.readouterr().err
    assert (report / "runs.jsonl").exists(), "the results file defaults to the report folder"
    page = (report / "index.html").read_text()
    sweeps = list(report.glob("sweep_*.png"))
    assert len(sweeps) == 1 and sweeps[0].name in page
    assert (report / "ttft_cdf.png").exists()
    # The capacity table and the lines under it, as the terminal prints them.
    capacity = page[page.index("<h2>Capacity</h2>") : page.index("<h2>Summary</h2>")]
    assert "<th>capacity req/s</th>" in capacity and "<td>vllm</td>" in capacity
    assert "throughput ceiling" in capacity


def test_vllm_v0_only_when_asked_and_its_command_says_which_vllm_runs_it(tmp_path, capsys):
    from tailserve.tune.recommend import DEFAULT_TUNE_POLICIES

    # vLLM 0.11 removed V0: a default tune does not sweep it, and its pasted command says where it runs.
    assert "vllm-v0" not in DEFAULT_TUNE_POLICIES.split(",")
    args = [
        *TUNE,
        "--policies",
        "vllm-v0",
        "--chunk-sizes",
        "1024,2048",
        "--out",
        str(tmp_path / "runs.jsonl"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    command = re.search(r"^\s*VLLM_USE_V1=0 vllm serve .*\n\s*\((.*)\)$", out, re.M)
    assert command and "vLLM 0.10 or older" in command.group(1), out
