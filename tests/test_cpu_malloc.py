"""glibc's malloc tuned at CPU engine build (``cpu_malloc``): a step's freed activations are reused
by the next step instead of being given back and faulted in again, on the main thread and on an
engine thread of its own (``tailserve serve``); ``TAILSERVE_MALLOC=system`` keeps glibc's
defaults; an allocator that is not glibc's, or a user's own glibc settings, are left alone; a
bad value is a one-line error. Each case runs in a fresh interpreter: the knobs are process-wide
and set once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tailserve.executors.pytorch import cpu_malloc

glibc = pytest.mark.skipif(cpu_malloc._glibc() is None, reason="needs Linux with glibc")

# Blocks of 12 MiB allocated, written and freed together, 20 rounds; prints what the backend
# said and the most faults of the last five rounds (glibc 2.36's aligned allocations settle on
# reusing freed blocks within a few rounds). Transparent huge pages are turned off for the child
# (prctl PR_SET_THP_DISABLE) so that a fault is a 4 KiB page on every machine; the kernels are
# not built (the backend's tuning does not need them).
REUSE = textwrap.dedent(
    """
    import ctypes, resource, sys, threading, torch
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)
    from tailserve.executors.pytorch.cpu_backend import CpuBackend
    print(CpuBackend(torch.device("cpu")).malloc)
    blocks_per_round, on_thread = int(sys.argv[1]), sys.argv[2] == "thread"
    faults = []

    def rounds():
        for i in range(20):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [torch.empty(12 << 20, dtype=torch.uint8) for _ in range(blocks_per_round)]
            for t in blocks:
                t.fill_(1)
            del blocks, t
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    if on_thread:  # as ``tailserve serve`` steps its engine: a thread started after the build
        worker = threading.Thread(target=rounds)
        worker.start()
        worker.join()
    else:
        rounds()
    print(max(faults[-5:]))
    """
)
# A round's pages: 12 MiB is 3,072 of them.
PAGES = 3_072


def _run(malloc: str | None, blocks: int = 3, where: str = "main", **extra: str) -> tuple[str, int]:
    # The child's allocator is glibc's with its defaults unless a case says otherwise.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (cpu_malloc.ENV, "LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")
    }
    env.update(TAILSERVE_CPU_KERNEL="0", **extra)
    if malloc is not None:
        env[cpu_malloc.ENV] = malloc
    out = subprocess.run(
        [sys.executable, "-c", REUSE, str(blocks), where],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    said, faults = out.stdout.split("\n")[:2]
    return said, int(faults)


@glibc
def test_tuned_reuses_freed_blocks_without_page_faults() -> None:
    said, faults = _run(None)
    assert said == cpu_malloc.DESCRIPTION
    assert faults < PAGES // 3, faults  # 9,216 pages a round: at most a few are new


@glibc
def test_system_keeps_glibc_defaults() -> None:
    # No fault count asserted: under its defaults glibc moves its thresholds with the blocks it
    # has seen, and the same child faulted 9,184 pages a round in 6 of 12 runs, none in the rest.
    said, _ = _run("system")
    assert said == "glibc defaults (TAILSERVE_MALLOC=system)"


@glibc
def test_tuned_on_an_engine_thread() -> None:
    # 96 MiB a round: more than one of a thread arena's 64 MiB heaps, which glibc unmaps when
    # wholly free whatever the trim threshold; with one arena the thread uses the main heap.
    said, faults = _run(None, blocks=8, where="thread")
    assert said == cpu_malloc.DESCRIPTION
    assert faults < PAGES // 3, faults


@glibc
def test_a_users_glibc_settings_win() -> None:
    said, _ = _run(None, MALLOC_ARENA_MAX="2")
    assert said == "glibc as MALLOC_ARENA_MAX sets it (nothing tuned)"
    said, _ = _run(None, GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")
    assert said == "glibc as GLIBC_TUNABLES sets it (nothing tuned)"


def test_bad_value_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_malloc.ENV, "jemalloc")
    with pytest.raises(
        cpu_malloc.CpuMallocError, match=r"TAILSERVE_MALLOC='jemalloc': expected one of tuned, system"
    ):
        cpu_malloc.tune()  # checked at every call, after the first one too


def test_cli_reports_a_bad_value_in_one_line(tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    env = {**os.environ, cpu_malloc.ENV: "bogus"}
    out = subprocess.run(
        [sys.executable, "-m", "tailserve", "run", "--prompts", str(prompts), "--max-tokens", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "tailserve: error: TAILSERVE_MALLOC='bogus': expected one of tuned, system"
    )
    assert "Traceback" not in out.stderr
