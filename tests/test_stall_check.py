"""``explain --measured``: the real run's stalls against the twin's explanation of the same gaps.

Ground truth is the simulator again: a head-of-line run (short chats decoding, long prompts
arriving) priced by a known deployment is written as a recording; its replay on the same
deployment must catch every stall and name the same prefill, and a replay whose scheduler chunks
the long prompts must not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import write_recording
from tailserve.cli import main
from tailserve.fidelity.stall_check import SeenRequest, prefill_in_flight, seen_requests
from tailserve.sim.run_file import load_run
from tailserve.workloads.recorded import Measured, trace_line

DEPLOYMENT = ["--model", "Llama-3-8B", "--hardware", "A40", "--tp", "1"]
SYNC = ["--no-async-scheduling", "--max-num-batched-tokens", "4096"]


def _hol_trace(path: Path) -> Path:
    """Twenty short chats decoding, and a 3,000-token prompt at 0.6 s and 1.6 s (its prefill one
    iteration at a 4,096-token budget: one stall per chat per long prompt, under 1% of the gaps)."""
    lines = [trace_line(0.02 * i, 96, 300, Measured(0.0, [], 0, 0.0)) for i in range(20)]
    lines += [trace_line(t, 3000, 4, Measured(0.0, [], 0, 0.0)) for t in (0.6, 1.6)]
    path.write_text(
        "".join(json.dumps({k: v for k, v in x.items() if k != "measured"}) + "\n" for x in lines)
    )
    return path


def _simulate(trace: Path, flags: list[str], out: Path) -> Path:
    argv = [
        "simulate",
        "--trace",
        str(trace),
        *DEPLOYMENT,
        "--policy",
        "vllm",
        *flags,
        "--save-run",
        str(out),
    ]
    assert main(argv) == 0
    return out


def _as_recording(run_json: Path, path: Path) -> Path:
    """The run as a client would have recorded it (send time, TTFT, every gap)."""
    run = load_run(run_json)
    write_recording(sorted(run.requests, key=lambda r: int(r.request_id.removeprefix("trace-"))), path)
    return path


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("stalls")
    truth = _simulate(_hol_trace(d / "hol.jsonl"), SYNC, d / "truth.json")
    return _as_recording(truth, d / "rec.jsonl")


def test_the_twin_that_is_the_engine_catches_every_stall_and_names_its_prefill(
    recording: Path, tmp_path: Path, capsys
):
    replay = _simulate(recording, SYNC, tmp_path / "replay.json")
    out = tmp_path / "x.json"
    assert main(["explain", str(replay), "--measured", str(recording), "--json", str(out)]) == 0
    check = json.loads(out.read_text())["measured_stalls"]
    assert check["real_stalls"] == 40  # every short chat stalls behind each long prompt
    assert check["caught"] == check["same_cause"] == check["real_stalls"] and check["twin_only"] == 0
    assert check["gap_ratio_median"] == pytest.approx(1.0)
    blockers = {tuple(s["measured_blocker"]) for s in check["stalls"]}
    assert blockers == {("trace-20", 3000), ("trace-21", 3000)}
    # rich wraps at the console width, which the temp path's length moves
    assert "real stalls" in " ".join(capsys.readouterr().out.split())


def test_a_twin_that_chunks_the_long_prompts_misses_the_stalls(recording: Path, tmp_path: Path):
    replay = _simulate(recording, [*SYNC[:1], "--max-num-batched-tokens", "256"], tmp_path / "chunked.json")
    out = tmp_path / "x.json"
    assert main(["explain", str(replay), "--measured", str(recording), "--json", str(out)]) == 0
    check = json.loads(out.read_text())["measured_stalls"]
    assert check["real_stalls"] == 40 and check["caught"] < check["real_stalls"] // 2


def test_the_prefill_in_flight_is_the_one_that_covers_the_gap_most():
    seen = [
        SeenRequest("decode", 0.0, 50, (0.1, 0.2, 1.2)),
        SeenRequest("long", 0.15, 2000, (1.15,)),  # its prefill covers the whole 0.2-1.2 gap
        SeenRequest("short", 0.5, 300, (1.19,)),  # arrived during it, waited behind it
        SeenRequest("before", 0.0, 5000, (0.12,)),  # done before the gap
    ]
    assert prefill_in_flight(seen, "decode", 0.2, 1.2) == ("long", 2000)
    assert prefill_in_flight(seen, "decode", 1.18, 1.2) == ("short", 300)
    assert prefill_in_flight(seen, "decode", 1.3, 1.4) is None
    built = seen_requests(["a", "b"], [0.0, 1.0], [10, 20], [0.5, None], [[0.1, 0.2], []])
    assert built[0].token_times == pytest.approx((0.5, 0.6, 0.8)) and built[1].token_times == ()


def test_a_recording_the_run_does_not_replay_is_refused(recording: Path, tmp_path: Path, capsys):
    other = _simulate(_hol_trace(tmp_path / "h.jsonl"), SYNC, tmp_path / "other.json")
    short = tmp_path / "short.jsonl"
    lines = recording.read_text().splitlines()
    short.write_text(
        "\n".join([*lines, lines[0].replace('"arrival_time": 0.0', '"arrival_time": 9.0')]) + "\n"
    )
    assert main(["explain", str(other), "--measured", str(short)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "takes the recording the run replays" in err[0]


def test_a_faster_twin_is_matched_by_cause_not_by_token_index(recording: Path, tmp_path: Path):
    # On an H100 the chats are many tokens further on when each long prompt arrives: the same
    # stall falls at another token index, and is still the one that prompt causes.
    argv = ["simulate", "--trace", str(recording), "--model", "Llama-3-8B", "--hardware", "H100"]
    argv += ["--policy", "vllm", *SYNC, "--save-run", str(tmp_path / "fast.json")]
    assert main(argv) == 0
    out = tmp_path / "x.json"
    assert (
        main(["explain", str(tmp_path / "fast.json"), "--measured", str(recording), "--json", str(out)]) == 0
    )
    check = json.loads(out.read_text())["measured_stalls"]
    assert check["real_stalls"] == 40 and check["gap_ratio_median"] < 0.8  # a faster twin
    assert check["caught"] == check["same_cause"] == 40 and check["twin_only"] == 0
    moved = [s for s in check["stalls"] if s["twin_blocker"] == s["measured_blocker"]]
    assert len(moved) == 40
