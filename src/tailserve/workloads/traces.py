"""Replay recorded request traces as a list of ``Request`` sorted by arrival time.

Three formats are read, told apart by content rather than file extension:

- ``azure``: the Azure LLM inference trace CSV, header ``TIMESTAMP,ContextTokens,GeneratedTokens``
  with absolute timestamps such as ``2023-11-16 18:15:46.6805900``;
- ``mooncake``: Mooncake JSONL, ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``;
- ``tailserve``: JSONL, ``{"arrival_time": s, "prompt_len", "max_tokens", "priority"?,
  "tenant_id"?, "prefix_block_hashes"?, "prompt_token_ids"?, "measured"?}``; ``prompt_token_ids``
  (exactly ``prompt_len`` of them) key the simulator's prefix cache as the prompt's own tokens;
  ``measured`` is what a recording saw (``recorded.py``), not read here.

Every problem with a file raises ``TraceError`` whose message starts with ``<path>:<line>:``.
A row with 0 prompt or output tokens is such an error rather than being skipped: neither shared
production trace has one, so a zero means the file is not what the caller thinks it is.

The file is read one line at a time and reading stops after ``max_requests`` rows, so the first
thousand requests of a 200 MB trace cost what a thousand-line file costs. Every value is bounded
on the way in: a line is at most ``MAX_LINE_BYTES``, token counts at most ``MAX_TOKENS``, arrival
times at most ``MAX_ARRIVAL_S`` (below it a float keeps microseconds; beyond it the simulator's
clock would lose them, and an infinite gap overflows it), JSON nesting and CSV fields at most
what the parsers take, each refused with the line that holds it.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Iterator
from datetime import date
from operator import attrgetter
from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO

from tailserve.core.request import Request
from tailserve.workloads.errors import TraceError

TRACE_FORMATS = ("azure", "mooncake", "tailserve")
MAX_LINE_BYTES = 8 * 2**20  # one request per line: its hash list, not a payload
_READ_BYTES = 2**20
MAX_TOKENS = 2**24  # prompt or output tokens of one request: beyond any model's context
MAX_ARRIVAL_S = float(2**32)  # ~136 years; a float below it resolves 1 us
MAX_PRIORITY = 2**63 - 1  # vLLM's priority is an int64
_FORMAT_HELP = (
    "known formats: azure (CSV header TIMESTAMP,ContextTokens,GeneratedTokens), "
    "mooncake (JSONL with timestamp, input_length, output_length, hash_ids), "
    "tailserve (JSONL with arrival_time, prompt_len, max_tokens)"
)
_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)")
_TAILSERVE_KEYS = frozenset(
    {
        "arrival_time",
        "prompt_len",
        "max_tokens",
        "priority",
        "tenant_id",
        "prefix_block_hashes",
        "prompt_token_ids",
        "measured",
    }
)

Lines = Iterator[tuple[int, str]]  # (1-based line number, the line without its line break)


class _TraceFile:
    """The lines of a UTF-8 trace file, read lazily; a context manager that closes the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file: BinaryIO = path.open("rb")
        except FileNotFoundError:
            raise TraceError(f"{path}: no such trace file") from None
        except OSError as error:
            raise TraceError(f"{path}: cannot read trace file ({error.strerror})") from None

    def __enter__(self) -> _TraceFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def lines(self) -> Lines:
        path, number, carry = self.path, 0, b""
        while True:
            try:
                block = self._file.read(_READ_BYTES)
            except OSError as error:  # e.g. a directory, or an I/O error mid-file
                raise TraceError(f"{path}: cannot read trace file ({error.strerror})") from None
            if block:
                *complete, carry = (carry + block).split(b"\n")
            else:
                complete, carry = ([carry] if carry else []), b""
            for raw in complete:
                number += 1
                yield number, self._decode(number, raw)
            if len(carry) > MAX_LINE_BYTES:
                self._decode(number + 1, carry)  # raises: the line is too long
            if not block:
                return

    def _decode(self, number: int, raw: bytes) -> str:
        if len(raw) > MAX_LINE_BYTES + 1:  # + 1: a CR before the LF
            raise TraceError(
                f"{self.path}:{number}: line is longer than {MAX_LINE_BYTES:,} bytes "
                "(one request per line; is this a trace?)"
            )
        try:
            # utf-8-sig drops a byte-order mark, which spreadsheet exports put before the header.
            return raw.decode("utf-8-sig" if number == 1 else "utf-8").removesuffix("\r")
        except UnicodeDecodeError as error:
            raise TraceError(f"{self.path}:{number}: not UTF-8 text ({error.reason})") from None


def _first_line(path: Path, lines: Lines) -> tuple[int, str]:
    """The first non-blank line and its 1-based number."""
    for number, line in lines:
        if line.strip():
            return number, line.strip()
    raise TraceError(f"{path}: empty trace file; {_FORMAT_HELP}")


def _loads(path: Path, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{path}:{number}: invalid JSON ({error.msg})") from None
    except RecursionError:
        raise TraceError(f"{path}:{number}: invalid JSON (nested too deeply)") from None
    except ValueError as error:  # an integer of more than sys.get_int_max_str_digits() digits
        raise TraceError(f"{path}:{number}: invalid JSON ({error})") from None


def _detect(path: Path, number: int, line: str) -> str:
    if line.startswith("{"):
        first = _loads(path, number, line)
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
    with _TraceFile(path) as trace:
        return _detect(path, *_first_line(path, trace.lines()))


def load_trace(
    path: str | PathLike[str],
    *,
    rate_scale: float = 1.0,
    max_requests: int | None = None,
    format: str | None = None,
) -> list[Request]:
    """Read a trace into requests sorted by arrival time (ties keep file order).

    ``rate_scale`` multiplies the arrival rate: arrival times are divided by it, so 2 replays
    the trace twice as fast. ``max_requests`` keeps the first N requests of the file (the
    earliest N of a trace in time order, as recorded traces are) and reads no further.
    Request ids are ``trace-<i>`` with ``i`` the 0-based data row in the file.
    """
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    if format is not None and format not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {format!r}; known: {', '.join(TRACE_FORMATS)}")
    path = Path(path)
    limit = max_requests if max_requests is not None else math.inf
    with _TraceFile(path) as trace:
        lines = trace.lines()
        first = _first_line(path, lines)
        kind = format if format is not None else _detect(path, *first)
        rows = _chain(first, lines)
        if kind == "azure":
            requests = _parse_azure(path, rows, limit)
        elif kind == "mooncake":
            requests = _parse_mooncake(path, rows, limit)
        else:
            requests = _parse_tailserve(path, rows, limit)
    requests.sort(key=attrgetter("arrival_time"))
    if rate_scale != 1.0:
        for request in requests:
            request.arrival_time /= rate_scale
        if requests and requests[-1].arrival_time > MAX_ARRIVAL_S:
            last = requests[-1]
            raise ValueError(
                f"{path}: rate_scale {rate_scale:g} puts {last.request_id} at {last.arrival_time:.4g} s, "
                f"beyond the {MAX_ARRIVAL_S:.4g} s a trace may span"
            )
    return requests


def _chain(first: tuple[int, str], rest: Lines) -> Lines:
    yield first
    yield from rest


def _token_count(path: Path, number: int, name: str, value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise TraceError(f"{path}:{number}: {name} is not an integer: {_shown(value)}") from None
    if count < 1:
        raise TraceError(f"{path}:{number}: {name} must be >= 1 token, got {_shown(count)}")
    if count > MAX_TOKENS:
        raise TraceError(f"{path}:{number}: {name} must be <= {MAX_TOKENS:,} tokens, got {_shown(count)}")
    return count


def _csv_rows(path: Path, rows: Lines) -> Iterator[tuple[int, list[str]]]:
    """CSV records of one line each (a quoted field cannot hold a line break here)."""
    number = 0

    def text() -> Iterable[str]:
        nonlocal number
        for number, line in rows:  # noqa: B007 (``number`` is the line the reader is on)
            yield line

    reader = csv.reader(text())
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as error:  # a field over csv.field_size_limit(), a NUL byte, ...
            raise TraceError(f"{path}:{number}: malformed CSV ({error})") from None
        yield number, fields


def _parse_azure(path: Path, rows: Lines, limit: float) -> list[Request]:
    records = _csv_rows(path, rows)
    header_number, header = next(((n, f) for n, f in records if "".join(f).strip()), (0, []))
    header = [_header_name(name) for name in header]
    missing = [name for name in _AZURE_COLUMNS if name not in header]
    if missing:
        raise TraceError(
            f"{path}:{header_number}: Azure header lacks {', '.join(missing)}; "
            "expected TIMESTAMP,ContextTokens,GeneratedTokens"
        )
    time_col, prompt_col, output_col = (header.index(name) for name in _AZURE_COLUMNS)
    num_columns = len(header)
    ordinals: dict[str, int] = {}  # date text -> day number; a trace spans only a few dates
    found: list[tuple[int, int, float, int, int]] = []  # (line, day, seconds of day, prompt, output)
    for number, fields in records if limit > 0 else ():
        if len(fields) != num_columns:
            if not "".join(fields).strip():
                continue
            raise TraceError(f"{path}:{number}: expected {num_columns} columns, got {len(fields)}")
        stamp = fields[time_col].strip()
        match = _AZURE_TIME.fullmatch(stamp)
        if match is None:
            raise TraceError(f"{path}:{number}: bad timestamp {_shown(stamp)}")
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
        found.append((number, ordinal, hours * 3600 + minutes * 60 + seconds, prompt_len, output_len))
        if len(found) >= limit:
            break  # no row after the last one kept is read
    if not found:
        return []
    # Offsets from the earliest row (the first row of a sorted trace). Day and time of day are
    # kept apart until now because absolute seconds (~6e10) would eat the 0.1 us resolution.
    day0, time0 = min((row[1], row[2]) for row in found)
    requests = []
    for i, (number, day, time, prompt_len, output_len) in enumerate(found):
        offset = (day - day0) * 86400.0 + (time - time0)
        if offset > MAX_ARRIVAL_S:
            raise TraceError(
                f"{path}:{number}: timestamp is {offset:.4g} s after the trace's first, "
                f"beyond the {MAX_ARRIVAL_S:.4g} s a trace may span"
            )
        requests.append(Request(f"trace-{i}", prompt_len, output_len, offset))
    return requests


def _json_objects(path: Path, rows: Lines, limit: float) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects of the JSON lines, at most ``limit`` of them (no line after the last is read)."""
    count = 0
    for number, line in rows if limit > 0 else ():
        if not line.strip():
            continue
        obj = _loads(path, number, line)
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj
        count += 1
        if count >= limit:
            return


def _field(path: Path, number: int, obj: dict[str, Any], key: str) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise TraceError(f"{path}:{number}: missing key {key!r}") from None


def _json_int(
    path: Path, number: int, obj: dict[str, Any], key: str, minimum: int, maximum: int = MAX_TOKENS
) -> int:
    value = _field(path, number, obj, key)
    # bool is an int subclass in Python, but `true` is never a token count.
    if type(value) is not int:
        raise TraceError(f"{path}:{number}: {key} must be an integer, got {_shown(value)}")
    if value < minimum:
        raise TraceError(f"{path}:{number}: {key} must be >= {minimum}, got {_shown(value)}")
    if value > maximum:
        raise TraceError(f"{path}:{number}: {key} must be <= {maximum:,}, got {_shown(value)}")
    return value


def _json_time(path: Path, number: int, obj: dict[str, Any], key: str, per_second: float = 1.0) -> float:
    """A time >= 0 in units of which ``per_second`` make a second (1000: ms), as seconds; at most
    ``MAX_ARRIVAL_S``."""
    value = _field(path, number, obj, key)
    finite = type(value) is int or (type(value) is float and math.isfinite(value))
    if not finite or value < 0:
        raise TraceError(f"{path}:{number}: {key} must be a number >= 0, got {_shown(value)}")
    if value > MAX_ARRIVAL_S * per_second:  # compared as is: an integer may be too big for a float
        unit = "s" if per_second == 1.0 else "ms"
        raise TraceError(
            f"{path}:{number}: {key} must be <= {MAX_ARRIVAL_S * per_second:.4g} {unit} "
            f"(below it a float keeps microseconds), got {_shown(value)}"
        )
    return float(value) / per_second


def _shown(value: Any) -> str:
    """A value for an error message, cut short: a bad field may be a megabyte of JSON."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _json_hashes(path: Path, number: int, value: Any, key: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(h) is int for h in value):
        raise TraceError(f"{path}:{number}: {key} must be a list of integers")
    return value


def _parse_mooncake(path: Path, rows: Lines, limit: float) -> list[Request]:
    requests: list[Request] = []
    for i, (number, obj) in enumerate(_json_objects(path, rows, limit)):
        arrival_time = _json_time(path, number, obj, "timestamp", per_second=1000.0)
        prompt_len = _json_int(path, number, obj, "input_length", 1)
        output_len = _json_int(path, number, obj, "output_length", 1)
        hashes = _json_hashes(path, number, obj.get("hash_ids"), "hash_ids")
        requests.append(
            Request(f"trace-{i}", prompt_len, output_len, arrival_time, prefix_block_hashes=hashes)
        )
    return requests


def _parse_tailserve(path: Path, rows: Lines, limit: float) -> list[Request]:
    requests: list[Request] = []
    for i, (number, obj) in enumerate(_json_objects(path, rows, limit)):
        unknown = obj.keys() - _TAILSERVE_KEYS
        if unknown:
            # Rejected rather than ignored: a misspelt optional key ("priorty") would otherwise
            # silently change the experiment.
            raise TraceError(
                f"{path}:{number}: unknown key(s) {_shown(', '.join(sorted(unknown)))}; "
                f"known: {', '.join(sorted(_TAILSERVE_KEYS))}"
            )
        arrival_time = _json_time(path, number, obj, "arrival_time")
        prompt_len = _json_int(path, number, obj, "prompt_len", 1)
        max_tokens = _json_int(path, number, obj, "max_tokens", 1)
        priority = obj.get("priority", 0)
        if type(priority) is not int or not -MAX_PRIORITY - 1 <= priority <= MAX_PRIORITY:
            raise TraceError(f"{path}:{number}: priority must be a 64-bit integer, got {_shown(priority)}")
        tenant_id = obj.get("tenant_id")
        if tenant_id is not None and not isinstance(tenant_id, str):
            raise TraceError(f"{path}:{number}: tenant_id must be a string, got {_shown(tenant_id)}")
        hashes = _json_hashes(path, number, obj.get("prefix_block_hashes"), "prefix_block_hashes")
        token_ids = _json_hashes(path, number, obj.get("prompt_token_ids"), "prompt_token_ids")
        if token_ids is not None and len(token_ids) != prompt_len:
            raise TraceError(
                f"{path}:{number}: prompt_token_ids holds {len(token_ids)} ids, prompt_len is {prompt_len}"
            )
        measured = obj.get("measured")
        if measured is not None and not isinstance(measured, dict):
            raise TraceError(f"{path}:{number}: measured must be an object, got {_shown(measured)}")
        requests.append(
            Request(
                f"trace-{i}",
                prompt_len,
                max_tokens,
                arrival_time,
                priority=priority,
                tenant_id=tenant_id,
                prefix_block_hashes=hashes,
                prompt_token_ids=token_ids,
            )
        )
    return requests
