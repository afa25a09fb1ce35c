"""What a policy promises the simulator's exact fast paths (``driver.py``), and nothing else.

The fast paths advance many iterations in one step: a run of identical decode-only iterations
(``decode_run.py``; ``async_decode_run.py`` under vLLM's async scheduling), a prompt chunked
beside decodes (``chunk_run.py``) and a prompt chunked alone (``prefill_run.py``). Each is exact only if the policy would have decided every skipped
iteration the same way, a contract only the policy can sign. So it is opt-in: a policy that
inherits ``FastPaths`` declares the contract (the defaults below are the common case: decode
runs whenever everyone is one token behind, no chunk runs); a policy that does not
(``static``, whose batches wait on a timer) is always stepped. The engine, the scheduler and
the ``Policy`` base class know nothing of this; only the simulator's driver asks.

Kept apart from the driver so a policy can import it without importing the engine: it needs
only the scheduler's types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class LoneChunkRun:
    """What a policy promises for its next iterations: each grants ``request`` (and nobody
    else) ``chunk`` tokens, for ``max_steps`` iterations unless an arrival comes first."""

    request: Request
    chunk: int  # tokens per iteration, >= 2
    max_steps: int


class FastPaths:
    """The exactness contracts of the fast paths (see each docstring); mixed into a ``Policy``."""

    # Free blocks a decode iteration must leave untouched or it preempts (Sarathi: 1).
    decode_reserve_blocks: ClassVar[int] = 0
    # ``chunk_run.py`` may add arrivals inside a run of full-chunk iterations: True only where a
    # request that arrives then can neither join such an iteration nor change the policy's later
    # decisions except by waiting (or being rejected) — TGI, whose router has no prefill budget
    # left beside a full chunk, and Sarathi, whose full chunk spends the iteration's budget.
    chunk_run_takes_arrivals: ClassVar[bool] = False
    # ``chunk_run.py`` may end a run with the iteration in which decodes produce their last
    # token (they finish at its end, in arrival order): True only where that iteration is
    # decided as the others (the finish changes nothing before the next one) and the step
    # applies its decodes in arrival order — Sarathi. Not TGI: its shard plans the prompt's
    # next chunk around a finish (``on_chunk_run`` does not re-derive that), so it steps there.
    chunk_run_ends_at_finish: ClassVar[bool] = False
    # The batch record (``--save-run``, ``--explain``, ``--report``) keeps an async decode run
    # (``async_decode_run.py``) as one entry of its steps; False: one entry per step, as stepping
    # records them (SGLang: its saved runs in the golden corpus were recorded stepped).
    batch_entry_per_async_run: ClassVar[bool] = True
    # ``async_decode_run.py`` may start a run with a prefill batch in flight that holds only the
    # newest running requests (the tail of the running set, in its order), the others having
    # nothing in flight: True only where, with nobody waiting, the turn after such a batch
    # decodes every running request one token as any decode turn does — SGLang's overlap
    # scheduler (the prefill batch joins the running batch; ``update_running_batch`` decodes
    # all of it, the new requests on the placeholders of their first tokens). vLLM and
    # TensorRT-LLM schedule the running decodes beside every prefill: never that state.
    async_run_after_prefill: ClassVar[bool] = False
    # ``async_decode_run.py`` may go on, in one call, from a run that ends with its skipping
    # step into the runs after it (one-token slots, the plain KV manager: ``_chain``), applying
    # the outputs of the requests that stay running once, at the end. True only where this
    # policy's ``on_decode_run`` and ``on_finished`` read nothing of a running request but
    # its identity and status (SGLang: the decaying ratio, the last batch; ``fairness=vtc``
    # charges by tenant): between the runs of a chain they see those requests' counters as
    # they were before it.
    async_runs_chain: ClassVar[bool] = False

    def can_fast_forward(self, sched: Scheduler) -> bool:
        """True when, with every running request one token behind, this policy would schedule
        one decode for each of them, in running order, and admit nobody, for as long as no
        request arrives or finishes and the free KV blocks suffice — i.e. its decision depends on
        nothing but the running set and the free blocks (which only shrink while decoding). The
        driver then simulates such a run of iterations in one exact step. A policy whose state
        changes per decode iteration keeps it exact through ``on_decode_run``.

        Under vLLM's async scheduling (``Scheduler.async_scheduling``) the same promise is read
        with that pass's accounting (``async_decode_run.py``): with every running request's
        next token an output placeholder of the step in flight, one token each on it, in
        running order, nobody admitted — except that a request whose step in flight yields its
        last token is skipped (vLLM's ``max_tokens`` guard), and with nobody waiting that
        skipping step admits nobody either."""
        return True

    def arrivals_wait_in_async_runs(self, sched: Scheduler) -> bool:
        """For ``async_decode_run.py``: True when, with requests waiting and the async run's
        state (the step in flight admitted and preempted nobody, and nobody finished since it
        was scheduled), a request arriving now cannot change this policy's next decisions before
        a request finishes: it only joins the waiting queue behind a head that cannot be
        admitted. The run then adds arrivals at the steps that would add them instead of
        stopping there. False by default (a queue that reorders, or admits past its head, or a
        budget an arrival could fit into, must step)."""
        return False

    def on_decode_run(self, sched: Scheduler, num_steps: int) -> None:
        """Called after the driver advanced ``num_steps`` decode-only iterations in one step:
        apply whatever per-iteration bookkeeping the policy keeps (counters, decaying ratios)
        exactly as ``num_steps`` calls of ``schedule`` would have, each scheduling the running
        requests (an async run's skipping step: called with 1 once the requests it skipped have
        finished, so the running set is the step's)."""
        return None

    def chunk_run_budget(self) -> int | None:
        """The fixed token budget of a Sarathi-style iteration (decodes first, then one prompt
        chunked to fill the budget), for ``chunk_run.py``'s exact fast path; None (the default)
        when the policy's iterations are not of that shape."""
        return None

    def chunk_run_ready(self, sched: Scheduler) -> bool:
        """A cheap test before ``chunk_run.py`` scans the running batch: False when the policy
        knows no prompt is being chunked (TGI: no chunk planned); True by default."""
        return True

    def chunk_run_grants(self, sched: Scheduler, prompt: Request, chunk: int) -> bool:
        """For ``chunk_run.py``: whether the next iteration grants ``prompt`` ``chunk`` tokens
        beside one token per decode, as ``chunk_run_budget`` implies. A policy that plans a
        prompt's next chunk one forward ahead (TGI) checks its plan here; True by default."""
        return True

    def on_chunk_run(self, sched: Scheduler, prompt: Request, num_steps: int) -> None:
        """After the driver advanced ``num_steps`` iterations of ``chunk_run.py`` (already applied
        to ``prompt`` and the decodes): leave the policy's state as ``num_steps`` calls of
        ``schedule`` would have."""
        return None

    def lone_chunk_run(self, sched: Scheduler) -> LoneChunkRun | None:
        """For ``prefill_run.py``'s exact fast path: when the next iterations each grant one
        chunked prompt the same full chunk and nobody else anything (SGLang's chunked request
        without mixed decodes), that request, the chunk and how many such iterations follow if
        nothing arrives; None (the default) otherwise."""
        return None

    def on_lone_chunk_run(self, sched: Scheduler, num_steps: int) -> None:
        """After the driver advanced ``num_steps`` iterations promised by ``lone_chunk_run``:
        leave the policy's state as ``num_steps`` calls of ``schedule`` would have."""
        return None
