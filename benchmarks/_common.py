"""What every benchmark shares (standard library only: vLLM's driver imports this from vLLM's venv).

- **Paths.** Peer engines live in venvs under ``${TAILSERVE_PEERS:-<repo>/.peers}/<name>``, made
  by ``scripts/setup-peers.sh``; nothing defaults to a path of one machine. Results go to
  ``benchmarks/out/`` (git-ignored) unless ``--out`` names a file; the current figures the docs
  quote are ``benchmarks/results/NAME.json``, one per benchmark. Public traces are read from
  ``../shared/traces/`` beside the clone.
- **Host.** The CPU's SIMD features (AVX-512, AMX) printed and saved beside every timing, since
  tailserve's and the peers' ratios depend on them.
- **Quiet machine.** On a shared 2-core box another job can make a run 2-10x slower, so a timed
  section starts only once the whole machine has been nearly idle for a few seconds, and records,
  beside its own CPU-seconds, how many CPU-seconds the whole machine was busy: ``other_cpu_s`` is
  what somebody else used meanwhile.
- **Child processes.** ``module_cmd`` / ``module_env`` run another benchmark module
  (``python -m benchmarks.NAME``) in a fresh interpreter, the repository on its ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT_DIR = HERE / "out"


def peers_dir() -> Path:
    base = os.environ.get("TAILSERVE_PEERS")
    return Path(base).expanduser() if base else REPO / ".peers"


def peer_venv(name: str) -> Path:
    return peers_dir() / name


def missing_peer(name: str, venv: Path | str) -> str:
    """The message when a peer engine's venv is absent: where it was looked for, how to make it."""
    return (
        f"{name}'s venv is not at {venv} (no {Path(venv) / 'bin' / 'python'}). Create it with "
        f"`scripts/setup-peers.sh {name}` (venvs go under $TAILSERVE_PEERS, default <repo>/.peers), "
        f"or pass --{name}-venv DIR."
    )


def default_out(filename: str) -> Path:
    """``benchmarks/out/FILENAME`` (created), the git-ignored default for a results file."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / filename


def save_results(results: dict, out: str | Path | None, filename: str) -> Path:
    """Write a benchmark's results as JSON to ``out`` (default ``benchmarks/out/FILENAME``), with
    the host's SIMD flags under ``cpu_flags`` unless the results carry them, say where, and return
    the path."""
    path = Path(out) if out else default_out(filename)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(results, dict) and "cpu_flags" not in results:
        results = {**results, "cpu_flags": simd_flags()}
    path.write_text(json.dumps(results, indent=1))
    print(f"results: {path}")
    return path


def module_cmd(python: str | Path, name: str, *args: str) -> list[str]:
    """The command running ``benchmarks.NAME`` as a module under ``python`` (use with
    ``module_env``, which puts the repository on the child's ``PYTHONPATH``)."""
    return [str(python), "-m", f"benchmarks.{name}", *map(str, args)]


def module_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the repository first on ``PYTHONPATH``, so a child
    interpreter finds the ``benchmarks`` package wherever it is started."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


# The public traces the benchmarks replay by default, and where each comes from.
TRACE_SOURCES = {
    "azure_llm_2023_conv.csv": "Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset, "
    "data/AzureLLMInferenceTrace_conv.csv; CC-BY 4.0)",
    "mooncake_conversation.jsonl": "Mooncake conversation trace (github.com/kvcache-ai/Mooncake, "
    "FAST25-release/traces/conversation_trace.jsonl; Apache-2.0)",
}
TRACES_DIR = REPO.parent / "shared" / "traces"  # beside the clone, as docs/cli.md says


def default_trace(filename: str) -> Path:
    return TRACES_DIR / filename


def check_trace(path: str | Path) -> str | None:
    """None when the trace exists, else one line saying where to get it."""
    p = Path(path)
    if p.is_file():
        return None
    source = TRACE_SOURCES.get(p.name)
    where = f"; it is the {source}" if source else ""
    return f"no trace at {p}{where}. Download it there or pass --trace PATH."


# ---- host ----------------------------------------------------------------------------------
_SIMD = ("avx2", "fma", "f16c")  # the avx2 level's instructions (cpu_isa), named beside AVX-512's


def simd_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CPU's AVX2/FMA/F16C, AVX-512 and AMX flags, sorted; [] where /proc/cpuinfo is
    unreadable (an AVX2-only CPU shows the first three alone)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            return sorted(
                f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx")) or f in _SIMD
            )
    return []


@contextmanager
def forced_level(level: str) -> Iterator[None]:
    """tailserve's own kernel choices at CPU ``level`` inside the block (``TAILSERVE_CPU_ISA``),
    whatever the variable held before restored after. PyTorch's dispatch is read once at start-up
    and stays this process's."""
    name = "TAILSERVE_CPU_ISA"
    before = os.environ.get(name)
    os.environ[name] = level
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def cpu_line() -> str:
    """``CPU: <model>; <flags>``, the line every benchmark prints beside its figures."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = " ".join(simd_flags()) or "no AVX2/AVX-512/AMX flags"
    return f"CPU: {model or 'unknown model'}, {os.cpu_count()} cores; {flags}"


def load_averages() -> list[str]:
    """The 1-, 5- and 15-minute load averages as ``/proc/loadavg`` writes them."""
    return Path("/proc/loadavg").read_text().split()[:3]


def run_stamp(name: str, show: Callable[[str], object] = print) -> dict[str, Any]:
    """Print the CPU line and the load average and time beside a run's figures (with ``show``, a
    console's ``print`` for a rich table's benchmark), and return the results' header: the
    benchmark, the date, the command line and the load average."""
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    show(cpu_line())
    show(f"load average {load:.2f}, {date}")
    return {
        "benchmark": name,
        "date": date,
        "command": f"python -m benchmarks.{name} " + " ".join(sys.argv[1:]),
        "load_average": load,
    }


# ---- quiet machine ---------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")  # /proc counters are in clock ticks
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice.
# Busy = user + nice + system + irq + softirq (guest time is already inside user); steal is time
# the hypervisor gave to another VM, kept apart as a sign of a noisy host.
_BUSY = (0, 1, 2, 5, 6)
_STEAL = 7
HOLD_S = 3.0  # seconds the machine must stay quiet before a timed section starts


@dataclass(frozen=True, slots=True)
class MachineCpu:
    busy_s: float  # CPU-seconds all cores spent busy since boot
    steal_s: float


def machine_cpu() -> MachineCpu:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    steal = fields[_STEAL] if len(fields) > _STEAL else 0
    return MachineCpu(sum(fields[i] for i in _BUSY) / _TICK, steal / _TICK)


def own_cpu_s() -> float:
    """CPU-seconds of this process, its reaped children (``getrusage``) and its live descendants
    (``/proc``: vLLM's engine core is a child process that lives until shutdown)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total + sum(_proc_cpu_s(pid) for pid in _descendants(os.getpid()))


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _read_stat(entry / "stat")
        if stat is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found: list[int] = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def _read_stat(path: Path) -> list[str] | None:
    """Fields after the command name (which may hold spaces): state, ppid, ..."""
    try:
        text = path.read_text()
    except OSError:  # the process ended meanwhile
        return None
    return text[text.rfind(")") + 2 :].split()


def _proc_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime: a descendant's own reaped children count through it."""
    stat = _read_stat(Path(f"/proc/{pid}/stat"))
    if stat is None:
        return 0.0
    return sum(int(x) for x in stat[11:15]) / _TICK


@dataclass(frozen=True, slots=True)
class QuietResult:
    quiet: bool  # False: timed out, the section ran on a busy machine (a warning)
    waited_s: float
    busy_cores: float  # the machine's busy cores over the last sample
    threshold_cores: float
    hold_s: float


def wait_quiet(
    threshold_cores: float = 0.2,
    hold_s: float = HOLD_S,
    timeout_s: float = 300.0,
    on_wait: Callable[[float, float], None] | None = None,
) -> QuietResult:
    """Block until the machine's busy CPU stays below ``threshold_cores`` for ``hold_s`` seconds.

    Gives up after ``timeout_s`` and says so (``quiet=False``) rather than hanging forever.
    ``on_wait(busy_cores, waited_s)`` is called once if the wait outlasts the quickest possible
    one (the machine was busy), so the caller can say what it waits for before a silent wait of
    up to ``timeout_s``.
    """
    poll = 0.5
    start = time.monotonic()
    quiet_since: float | None = None
    last = machine_cpu().busy_s
    busy = float("nan")
    told = False
    while True:
        time.sleep(poll)
        now = time.monotonic()
        cur = machine_cpu().busy_s
        busy = (cur - last) / poll
        last = cur
        quiet_since = (
            (quiet_since if quiet_since is not None else now - poll) if busy < threshold_cores else None
        )
        if quiet_since is not None and now - quiet_since >= hold_s:
            return QuietResult(True, now - start, busy, threshold_cores, hold_s)
        if now - start >= timeout_s:
            return QuietResult(False, now - start, busy, threshold_cores, hold_s)
        if on_wait is not None and not told and now - start > hold_s + poll:
            told = True
            on_wait(busy, now - start)


class CpuMeter:
    """``with CpuMeter() as m: ...``; then ``m.result()``: wall, own and whole-machine CPU-seconds."""

    def __enter__(self) -> CpuMeter:
        self._machine = machine_cpu()
        self._own = own_cpu_s()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.own_s = own_cpu_s() - self._own
        machine = machine_cpu()
        self.machine_busy_s = machine.busy_s - self._machine.busy_s
        self.steal_s = machine.steal_s - self._machine.steal_s

    def result(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "own_cpu_s": self.own_s,
            "machine_busy_cpu_s": self.machine_busy_s,
            # Tick granularity (10 ms per core) can make this slightly negative on a quiet box.
            "other_cpu_s": self.machine_busy_s - self.own_s,
            "steal_s": self.steal_s,
        }


def gated(threshold_cores: float, timeout_s: float) -> dict[str, Any]:
    """Wait for a quiet machine; the JSON record of how that went (with a warning if it was not)."""

    def say_waiting(busy: float, waited_s: float) -> None:
        left = max(timeout_s - waited_s, 0.0)
        print(
            f"waiting for a quiet machine before timing: {busy:.2f} cores busy (other processes), "
            f"below {threshold_cores} needed for {HOLD_S:g} s; up to {left:.0f} s more, then timed "
            "anyway with a warning",
            flush=True,
        )

    result = wait_quiet(threshold_cores, timeout_s=timeout_s, on_wait=say_waiting)
    record = asdict(result)
    if not result.quiet:
        record["warning"] = (
            f"machine not quiet after {result.waited_s:.0f} s ({result.busy_cores:.2f} busy cores, "
            f"threshold {threshold_cores}); timed anyway"
        )
        print(f"warning: {record['warning']}", flush=True)
    return record
