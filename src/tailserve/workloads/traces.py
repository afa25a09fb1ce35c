"""Replay recorded request traces as a list of ``Request`` sorted by arrival time.

Three formats are read, told apart by content rather than file extension:

- ``azure``: the Azure LLM inference trace CSV, header ``TIMESTAMP,ContextTokens,GeneratedTokens``
  with absolute timestamps such as ``2023-11-16 18:15:46.6805900``;
- ``mooncake``: Mooncake JSONL, ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``;
- ``tailserve``: JSONL, ``{"arrival_time": s, "prompt_len", "max_tokens", "priority"?,
  "tenant_id"?, "prefix_block_hashes"?}``.

Every problem with a file raises ``TraceError`` whose message starts with ``<path>:<line>:``.
A row with 0 prompt or output tokens is such an error rather than being skipped: neither shared
production trace has one, so a zero means the file is not what the caller thinks it is.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterator
from datetime import date
from operator import attrgetter
from os import PathLike
from pathlib import Path
from typing import Any

from tailserve.core.request import Request
from tailserve.workloads.errors import TraceError

TRACE_FORMATS = ("azure", "mooncake", "tailserve")
_FORMAT_HELP = (
    "known formats: azure (CSV header TIMESTAMP,ContextTokens,GeneratedTokens), "
    "mooncake (JSONL with timestamp, input_length, output_length, hash_ids), "
    "tailserve (JSONL with arrival_time, prompt_len, max_tokens)"
)
_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)")
_TAILSERVE_KEYS = frozenset(
    {"arrival_time", "prompt_len", "max_tokens", "priority", "tenant_id", "prefix_block_hashes"}
)


def _read_lines(path: Path) -> list[str]:
    try:
        # utf-8-sig drops a byte-order mark, which spreadsheet exports put before the header.
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except UnicodeDecodeError as error:
        raise TraceError(f"{path}: not a UTF-8 text file ({error.reason})") from None
    except OSError as error:
        raise TraceError(f"{path}: cannot read trace file ({error.strerror})") from None
    return text.splitlines()


def _first_line(path: Path, lines: list[str]) -> tuple[int, str]:
    """The first non-blank line and its 1-based number."""
    for number, line in enumerate(lines, start=1):
        if line.strip():
            return number, line.strip()
    raise TraceError(f"{path}: empty trace file; {_FORMAT_HELP}")


def _detect(path: Path, lines: list[str]) -> str:
    number, line = _first_line(path, lines)
    if line.startswith("{"):
        try:
            first = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{path}:{number}: invalid JSON ({error.msg})") from None
        if isinstance(first, dict):
            if "arrival_time" in first:
                return "tailserve"
            if "timestamp" in first and "input_length" in first:
                return "mooncake"
    elif set(_AZURE_COLUMNS) <= {_header_name(name) for name in line.split(",")}:
        return "azure"
    raise TraceError(f"{path}: unknown trace format (first line {line[:80]!r}); {_FORMAT_HELP}")


def _header_name(name: str) -> str:
    return name.strip().strip('"').strip().lower()


def detect_format(path: str | PathLike[str]) -> str:
    """The trace format of ``path`` (one of ``TRACE_FORMATS``), judged from its first line."""
    path = Path(path)
    return _detect(path, _read_lines(path))


def load_trace(
    path: str | PathLike[str],
    *,
    rate_scale: float = 1.0,
    max_requests: int | None = None,
    format: str | None = None,
) -> list[Request]:
    """Read a trace into requests sorted by arrival time (ties keep file order).

    ``rate_scale`` multiplies the arrival rate: arrival times are divided by it, so 2 replays
    the trace twice as fast. ``max_requests`` keeps the first N requests by arrival time.
    Request ids are ``trace-<i>`` with ``i`` the 0-based data row in the file.
    """
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    if format is not None and format not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {format!r}; known: {', '.join(TRACE_FORMATS)}")
    path = Path(path)
    lines = _read_lines(path)
    kind = format if format is not None else _detect(path, lines)
    if kind == "azure":
        requests = _parse_azure(path, lines)
    elif kind == "mooncake":
        requests = _parse_mooncake(path, lines)
    else:
        requests = _parse_tailserve(path, lines)
    requests.sort(key=attrgetter("arrival_time"))
    if max_requests is not None:
        del requests[max_requests:]
    if rate_scale != 1.0:
        for request in requests:
            request.arrival_time /= rate_scale
    return requests


def _token_count(path: Path, number: int, name: str, value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise TraceError(f"{path}:{number}: {name} is not an integer: {value!r}") from None
    if count < 1:
        raise TraceError(f"{path}:{number}: {name} must be >= 1 token, got {count}")
    return count


def _parse_azure(path: Path, lines: list[str]) -> list[Request]:
    reader = csv.reader(lines)
    header_number, header = 0, []
    for fields in reader:
        if "".join(fields).strip():
            header_number, header = reader.line_num, [_header_name(name) for name in fields]
            break
    missing = [name for name in _AZURE_COLUMNS if name not in header]
    if missing:
        raise TraceError(
            f"{path}:{header_number}: Azure header lacks {', '.join(missing)}; "
            "expected TIMESTAMP,ContextTokens,GeneratedTokens"
        )
    time_col, prompt_col, output_col = (header.index(name) for name in _AZURE_COLUMNS)
    num_columns = len(header)
    ordinals: dict[str, int] = {}  # date text -> day number; a trace spans only a few dates
    rows: list[tuple[int, float, int, int]] = []  # (day, seconds of day, prompt, output)
    for fields in reader:
        number = reader.line_num
        if len(fields) != num_columns:
            if not "".join(fields).strip():
                continue
            raise TraceError(f"{path}:{number}: expected {num_columns} columns, got {len(fields)}")
        stamp = fields[time_col].strip()
        match = _AZURE_TIME.fullmatch(stamp)
        if match is None:
            raise TraceError(f"{path}:{number}: bad timestamp {stamp!r}")
        year, month, day, hour, minute, second = match.groups()
        ordinal = ordinals.get(stamp[:10])
        if ordinal is None:
            try:
                ordinal = date(int(year), int(month), int(day)).toordinal()
            except ValueError as error:
                raise TraceError(f"{path}:{number}: bad timestamp {stamp!r} ({error})") from None
            ordinals[stamp[:10]] = ordinal
        hours, minutes, seconds = int(hour), int(minute), float(second)
        if hours > 23 or minutes > 59 or seconds >= 61:  # 60.x is a leap second
            raise TraceError(f"{path}:{number}: bad timestamp {stamp!r}")
        prompt_len = _token_count(path, number, "ContextTokens", fields[prompt_col])
        output_len = _token_count(path, number, "GeneratedTokens", fields[output_col])
        rows.append((ordinal, hours * 3600 + minutes * 60 + seconds, prompt_len, output_len))
    if not rows:
        return []
    # Offsets from the earliest row (the first row of a sorted trace). Day and time of day are
    # kept apart until now because absolute seconds (~6e10) would eat the 0.1 us resolution.
    day0, time0 = min((row[0], row[1]) for row in rows)
    return [
        Request(f"trace-{i}", prompt_len, output_len, (day - day0) * 86400.0 + (time - time0))
        for i, (day, time, prompt_len, output_len) in enumerate(rows)
    ]


def _json_objects(path: Path, lines: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{path}:{number}: invalid JSON ({error.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def _field(path: Path, number: int, obj: dict[str, Any], key: str) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise TraceError(f"{path}:{number}: missing key {key!r}") from None


def _json_int(path: Path, number: int, obj: dict[str, Any], key: str, minimum: int) -> int:
    value = _field(path, number, obj, key)
    # bool is an int subclass in Python, but `true` is never a token count.
    if type(value) is not int:
        raise TraceError(f"{path}:{number}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{path}:{number}: {key} must be >= {minimum}, got {value}")
    return value


def _json_time(path: Path, number: int, obj: dict[str, Any], key: str) -> float:
    value = _field(path, number, obj, key)
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{path}:{number}: {key} must be a number >= 0, got {value!r}")
    return float(value)


def _json_hashes(path: Path, number: int, value: Any, key: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(h) is int for h in value):
        raise TraceError(f"{path}:{number}: {key} must be a list of integers")
    return value


def _parse_mooncake(path: Path, lines: list[str]) -> list[Request]:
    requests: list[Request] = []
    for i, (number, obj) in enumerate(_json_objects(path, lines)):
        arrival_time = _json_time(path, number, obj, "timestamp") / 1000.0  # ms -> s
        prompt_len = _json_int(path, number, obj, "input_length", 1)
        output_len = _json_int(path, number, obj, "output_length", 1)
        hashes = _json_hashes(path, number, obj.get("hash_ids"), "hash_ids")
        requests.append(
            Request(f"trace-{i}", prompt_len, output_len, arrival_time, prefix_block_hashes=hashes)
        )
    return requests


def _parse_tailserve(path: Path, lines: list[str]) -> list[Request]:
    requests: list[Request] = []
    for i, (number, obj) in enumerate(_json_objects(path, lines)):
        unknown = obj.keys() - _TAILSERVE_KEYS
        if unknown:
            # Rejected rather than ignored: a misspelt optional key ("priorty") would otherwise
            # silently change the experiment.
            raise TraceError(
                f"{path}:{number}: unknown key(s) {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(_TAILSERVE_KEYS))}"
            )
        arrival_time = _json_time(path, number, obj, "arrival_time")
        prompt_len = _json_int(path, number, obj, "prompt_len", 1)
        max_tokens = _json_int(path, number, obj, "max_tokens", 1)
        priority = obj.get("priority", 0)
        if type(priority) is not int:
            raise TraceError(f"{path}:{number}: priority must be an integer, got {priority!r}")
        tenant_id = obj.get("tenant_id")
        if tenant_id is not None and not isinstance(tenant_id, str):
            raise TraceError(f"{path}:{number}: tenant_id must be a string, got {tenant_id!r}")
        hashes = _json_hashes(path, number, obj.get("prefix_block_hashes"), "prefix_block_hashes")
        requests.append(
            Request(
                f"trace-{i}",
                prompt_len,
                max_tokens,
                arrival_time,
                priority=priority,
                tenant_id=tenant_id,
                prefix_block_hashes=hashes,
            )
        )
    return requests
