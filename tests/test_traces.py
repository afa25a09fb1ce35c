"""Trace replay: Azure CSV, Mooncake JSONL and tailserve JSONL, good files and broken ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tailserve.workloads.errors import TraceError
from tailserve.workloads.traces import TRACE_FORMATS, detect_format, load_trace

AZURE = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:47.0000000,1000,7
"""

MOONCAKE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 2500, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]},
    {"timestamp": 1000, "input_length": 512, "output_length": 5, "hash_ids": [3]},
]

TAILSERVE = [
    {"arrival_time": 0.5, "prompt_len": 100, "max_tokens": 20, "priority": 2, "tenant_id": "a"},
    {"arrival_time": 0.25, "prompt_len": 50, "max_tokens": 10},
]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def shape(requests) -> list[tuple[str, int, int, float]]:
    return [(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time) for r in requests]


# --- good files -----------------------------------------------------------------------------


def test_azure_offsets_from_the_first_row_and_sorts(tmp_path: Path) -> None:
    requests = load_trace(write(tmp_path, "azure.csv", AZURE))
    assert [r.request_id for r in requests] == ["trace-0", "trace-2", "trace-1"]
    assert [(r.prompt_len, r.max_tokens) for r in requests] == [(374, 44), (1000, 7), (396, 109)]
    assert requests[0].arrival_time == 0.0
    assert requests[1].arrival_time == pytest.approx(0.31941, abs=1e-9)
    assert requests[2].arrival_time == pytest.approx(4.314579, abs=1e-9)


def test_azure_across_midnight_and_with_crlf_and_blank_lines(tmp_path: Path) -> None:
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2023-12-31 23:59:59.5000000,10,1\r\n\r\n"
        "2024-01-01 00:00:00.2500000,20,2\r\n"
    )
    requests = load_trace(write(tmp_path, "azure.csv", text))
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, 0.75])


def test_mooncake_keeps_hash_ids_and_converts_ms(tmp_path: Path) -> None:
    requests = load_trace(write(tmp_path, "mc.jsonl", jsonl(MOONCAKE)))
    assert shape(requests) == [
        ("trace-0", 1024, 10, 0.0),
        ("trace-2", 512, 5, 1.0),
        ("trace-1", 600, 3, 2.5),
    ]
    assert [r.prefix_block_hashes for r in requests] == [[0, 1], [3], [0, 2]]


def test_tailserve_jsonl_with_optional_fields(tmp_path: Path) -> None:
    requests = load_trace(write(tmp_path, "t.jsonl", jsonl(TAILSERVE)))
    assert shape(requests) == [("trace-1", 50, 10, 0.25), ("trace-0", 100, 20, 0.5)]
    assert [(r.priority, r.tenant_id) for r in requests] == [(0, None), (2, "a")]


def test_format_is_detected_from_content_not_extension(tmp_path: Path) -> None:
    assert detect_format(write(tmp_path, "a.txt", AZURE)) == "azure"
    assert detect_format(write(tmp_path, "b.csv", jsonl(MOONCAKE))) == "mooncake"
    assert detect_format(write(tmp_path, "c.json", "\n" + jsonl(TAILSERVE))) == "tailserve"
    assert len(load_trace(write(tmp_path, "d.txt", jsonl(MOONCAKE)))) == 3


def test_explicit_format_overrides_detection(tmp_path: Path) -> None:
    path = write(tmp_path, "t.jsonl", jsonl(TAILSERVE))
    with pytest.raises(TraceError, match="missing key 'timestamp'"):
        load_trace(path, format="mooncake")
    with pytest.raises(ValueError, match="known: azure, mooncake, tailserve"):
        load_trace(path, format="sharegpt")


def test_rate_scale_divides_arrival_times(tmp_path: Path) -> None:
    path = write(tmp_path, "mc.jsonl", jsonl(MOONCAKE))
    assert [r.arrival_time for r in load_trace(path, rate_scale=2.0)] == [0.0, 0.5, 1.25]
    assert [r.arrival_time for r in load_trace(path, rate_scale=0.5)] == [0.0, 2.0, 5.0]
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="rate_scale"):
            load_trace(path, rate_scale=bad)


def test_max_requests_keeps_the_first_rows_and_reads_no_further(tmp_path: Path) -> None:
    path = write(tmp_path, "mc.jsonl", jsonl(MOONCAKE))
    # The file's first two rows, then sorted by arrival (a recorded trace is in time order).
    assert [r.request_id for r in load_trace(path, max_requests=2)] == ["trace-0", "trace-1"]
    assert len(load_trace(path, max_requests=10)) == 3
    assert load_trace(path, max_requests=0) == []
    # Lines after the Nth row are never read: a broken one there does not matter.
    broken = write(tmp_path, "broken.jsonl", jsonl(MOONCAKE[:2]) + "{not json\n")
    assert len(load_trace(broken, max_requests=2)) == 2
    with pytest.raises(TraceError, match=":3: invalid JSON"):
        load_trace(broken, max_requests=3)
    with pytest.raises(ValueError, match="-1"):
        load_trace(path, max_requests=-1)


# --- broken files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ("2023-11-16 18:15:47.0000000,374", "expected 3 columns, got 2"),
        ("2023-11-16 18:15:47.0000000,37x,44", "ContextTokens is not an integer: '37x'"),
        ("2023-11-16 18:15:47.0000000,374,-3", "GeneratedTokens must be >= 1 token, got -3"),
        ("2023-11-16 18:15:47.0000000,374,0", "GeneratedTokens must be >= 1 token, got 0"),
        ("2023-11-16 18:15:47.0000000,0,5", "ContextTokens must be >= 1 token, got 0"),
        ("yesterday,374,44", "bad timestamp 'yesterday'"),
        ("2023-13-16 18:15:47.0000000,374,44", "bad timestamp"),
        ("2023-11-16 25:15:47.0000000,374,44", "bad timestamp"),
    ],
)
def test_azure_malformed_row_names_file_and_line(tmp_path: Path, bad_row: str, message: str) -> None:
    lines = AZURE.splitlines()
    lines.insert(3, bad_row)  # line 4 of the file
    path = write(tmp_path, "azure.csv", "\n".join(lines) + "\n")
    with pytest.raises(TraceError) as error:
        load_trace(path)
    assert str(error.value).startswith(f"{path}:4: ")
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"timestamp": 5, "input_length": 10, "output_length": 2', "invalid JSON"),
        ('{"timestamp": 5, "input_length": 10}', "missing key 'output_length'"),
        ('{"timestamp": 5, "input_length": 1.5, "output_length": 2}', "input_length must be an"),
        ('{"timestamp": 5, "input_length": 10, "output_length": 0}', "output_length must be >= 1"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 2}', "timestamp must be a number"),
        ('{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": "x"}', "hash_ids"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_mooncake_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    text = jsonl(MOONCAKE[:2]) + "\n" + bad_line + "\n" + jsonl(MOONCAKE[2:])  # line 4
    path = write(tmp_path, "mc.jsonl", text)
    with pytest.raises(TraceError) as error:
        load_trace(path)
    assert str(error.value).startswith(f"{path}:4: ")
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"arrival_time": 1, "prompt_len": 10}', "missing key 'max_tokens'"),
        ('{"arrival_time": "soon", "prompt_len": 10, "max_tokens": 2}', "arrival_time must be"),
        ('{"arrival_time": 1, "prompt_len": -1, "max_tokens": 2}', "prompt_len must be >= 1"),
        ('{"arrival_time": 1, "prompt_len": 1, "max_tokens": true}', "max_tokens must be an"),
        ('{"arrival_time": 1, "prompt_len": 1, "max_tokens": 2, "priorty": 1}', "unknown key"),
        ('{"arrival_time": 1, "prompt_len": 1, "max_tokens": 2, "priority": "hi"}', "priority"),
        ('{"arrival_time": 1, "prompt_len": 1, "max_tokens": 2, "tenant_id": 7}', "tenant_id"),
    ],
)
def test_tailserve_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = write(tmp_path, "t.jsonl", jsonl(TAILSERVE) + bad_line + "\n")  # line 3
    with pytest.raises(TraceError) as error:
        load_trace(path)
    assert str(error.value).startswith(f"{path}:3: ")
    assert message in str(error.value)


def test_trace_error_is_a_value_error() -> None:
    assert issubclass(TraceError, ValueError)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "nope.csv")


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file_names_the_known_formats(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "empty.csv", text)
    with pytest.raises(TraceError, match="empty trace file") as error:
        detect_format(path)
    assert str(path) in str(error.value)
    assert all(name in str(error.value) for name in TRACE_FORMATS)


@pytest.mark.parametrize("text", ["time,in,out\n1,2,3\n", '{"prompt": "hi"}\n', "hello\n"])
def test_unknown_format_names_the_known_formats(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "odd.txt", text)
    with pytest.raises(TraceError, match="unknown trace format") as error:
        load_trace(path)
    assert str(path) in str(error.value)
    assert all(name in str(error.value) for name in TRACE_FORMATS)


def test_header_only_azure_file_has_no_requests(tmp_path: Path) -> None:
    assert load_trace(write(tmp_path, "a.csv", AZURE.splitlines()[0] + "\n")) == []


# --- the real shared traces -----------------------------------------------------------------


def shared_traces() -> Path | None:
    repo_root = Path(__file__).resolve().parents[1]
    for candidate in (Path("/work/shared/traces"), repo_root.parent / "shared" / "traces"):
        if candidate.is_dir():
            return candidate
    return None


@pytest.mark.parametrize(
    ("name", "kind", "rows"),
    [
        ("azure_llm_2023_conv.csv", "azure", 19_366),
        ("mooncake_conversation.jsonl", "mooncake", 12_031),
    ],
)
def test_real_shared_traces_load(name: str, kind: str, rows: int) -> None:
    folder = shared_traces()
    if folder is None or not (folder / name).is_file():
        pytest.skip(f"shared trace {name} absent: neither /work/shared/traces nor ../shared/traces")
    path = folder / name
    assert detect_format(path) == kind
    start = time.perf_counter()
    requests = load_trace(path)
    elapsed = time.perf_counter() - start
    assert len(requests) == rows
    assert requests[0].arrival_time == 0.0
    assert 3000 < requests[-1].arrival_time < 3700  # both span just under an hour
    # A generous bound so a loaded CI machine does not flake; typical is ~0.15 s.
    assert elapsed < 2.0
