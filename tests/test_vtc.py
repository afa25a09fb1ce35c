"""Virtual Token Counter: counters, the lift, the admission order, and VTC in front of vllm."""

from __future__ import annotations

import inspect
from typing import Any
from unittest import mock

import pytest

from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.policy import Policy
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_binding import PredictsIterations, bind_cost_model
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.fairness import (
    FairPolicy,
    TenantBacklog,
    make_backlog,
    policy_declarations,
    policy_hooks,
    with_fairness,
)
from tailserve.policies.registry import POLICIES
from tailserve.policies.vtc import VirtualTokenCounter, parse_tenant_weights

DEVICE = get_hardware("H100-SXM").device_info


def test_counters_advance_by_weighted_tokens():
    vtc = VirtualTokenCounter({"a": 2.0})
    vtc.charge("a", num_prefill_tokens=100, num_decode_tokens=10)  # (100*1 + 10*2) / 2
    vtc.charge("b", num_prefill_tokens=100, num_decode_tokens=10)  # weight 1
    assert vtc.counters == {"a": 60.0, "b": 120.0}
    assert vtc.pick(["b", "a"]) == "a"


def test_lift_to_the_least_backlogged_counter():
    vtc = VirtualTokenCounter(counters={"a": 500.0, "b": 300.0, "c": 0.0})
    vtc.on_backlogged("c", others=["a", "b"])  # c was idle: it may not bank 300 tokens of credit
    assert vtc.counter("c") == 300.0
    vtc.on_backlogged("a", others=["b", "c"])  # a is ahead: nothing changes
    assert vtc.counter("a") == 500.0


def test_lift_with_nobody_backlogged_uses_the_last_tenant_to_leave():
    vtc = VirtualTokenCounter(counters={"a": 800.0, "b": 0.0})
    vtc.on_idle("a")  # a's queue empties at counter 800
    vtc.on_backlogged("b", others=[])
    assert vtc.counter("b") == 800.0


def test_backlog_fires_the_lift_only_on_the_first_waiting_request():
    backlog = TenantBacklog(VirtualTokenCounter(counters={"a": 400.0}))
    a1, b1, b2 = (Request(i, 100, 10, 0.0, tenant_id=t) for i, t in (("a1", "a"), ("b1", "b"), ("b2", "b")))
    backlog.enqueue(a1)
    backlog.enqueue(b1)  # lifted to a's 400
    backlog.vtc.charge("b", 50)
    backlog.enqueue(b2)  # b already backlogged: no lift
    assert backlog.vtc.counter("b") == 450.0 and backlog.num_waiting == {"a": 1, "b": 2}
    backlog.dequeue(a1)
    assert backlog.vtc.last_left == 400.0


def test_order_is_the_papers_admission_sequence():
    # a at 0, b at 150; prompts of 100 tokens: a (0 -> 100), a (100 -> 200), b (150 -> 250), a, b
    backlog = TenantBacklog(VirtualTokenCounter(counters={"a": 0.0, "b": 150.0}))
    reqs = [Request(f"{t}{i}", 100, 1, 0.0, tenant_id=t) for t in "ab" for i in range(3)]
    assert [r.request_id for r in backlog.order(reqs)] == ["a0", "a1", "b0", "a2", "b1", "b2"]


def test_weights_parse_with_one_line_errors():
    assert parse_tenant_weights("a=2, b=1") == {"a": 2.0, "b": 1.0}
    for bad in ("a", "a=0", "a=x", "a=1,a=2", "=3"):
        with pytest.raises(ValueError, match="tenant-weights"):
            parse_tenant_weights(bad)


def test_fairness_only_where_the_queue_is_fcfs():
    vllm = POLICIES["vllm"]
    fcfs = vllm(vllm.default_config(DEVICE, 4096))
    assert isinstance(with_fairness(fcfs, "vtc"), FairPolicy)
    assert with_fairness(fcfs, "none") is fcfs
    prio = vllm(vllm.default_config(DEVICE, 4096, scheduling_policy="priority"))
    with pytest.raises(ValueError, match="keeps its own order"):
        with_fairness(prio, "vtc")
    with pytest.raises(ValueError, match="needs --fairness vtc"):
        with_fairness(fcfs, "none", "a=2")


def _two_tenants(
    name: str, fair: bool, flags: dict | None = None
) -> tuple[list[Request], VirtualTokenCounter | None]:
    """Tenant 'heavy' sends 10 prompts for every one of 'light'; both backlogged throughout."""
    cls = POLICIES[name]
    policy = cls(cls.default_config(DEVICE, 4096, **(flags or {})))
    if fair:
        policy = with_fairness(policy, "vtc") if name != "slo" else policy
    kv = KVCacheManager(4096 // 16 * 4, 16)
    sched = Scheduler(policy, kv, 4096)
    requests = []
    for i in range(220):
        tenant = "light" if i % 11 == 0 else "heavy"
        requests.append(Request(f"r{i}", 600, 60, 0.001 * i, tenant_id=tenant))
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    bind_cost_model(policy, cost)  # (slo) predicts with the simulator's cost model
    engine = Engine(sched, SimExecutor(cost, 16), ListSource(requests), options=EngineOptions(True, True))
    SimDriver(engine).run()
    backlog = getattr(policy, "backlog", None)
    return requests, backlog.vtc if backlog is not None else None


@pytest.mark.parametrize(
    "name,flags",
    [("vllm", None), ("sglang", None), ("slo", {"fairness": "vtc"})],
    ids=["vllm", "sglang", "slo"],
)
def test_vtc_serves_the_light_tenant_first_and_conserves_everything(name, flags):
    fair, vtc = _two_tenants(name, True, flags)
    plain, _ = _two_tenants(name, False)
    assert vtc is not None and all(r.is_finished for r in fair)

    def light_ttft(reqs: list[Request]) -> float:
        light = [r.token_times[0] - r.arrival_time for r in reqs if r.tenant_id == "light"]
        return sum(light) / len(light)

    assert light_ttft(fair) < 0.5 * light_ttft(plain)


def test_fairness_is_a_flag_of_any_spec_through_build_engine():
    from tailserve.assemble import build_engine
    from tailserve.executors.simulated.deployment import Deployment

    deployment = Deployment.of("Llama-3-8B", "H100-SXM", 1)
    built = build_engine(deployment, "vllm:fairness=vtc:tenant_weights=a=2/b=1")
    assert isinstance(built.policy, FairPolicy) and built.policy.backlog.vtc.weights == {"a": 2.0, "b": 1.0}
    assert build_engine(deployment, "slo:fairness=vtc").policy.backlog is not None
    with pytest.raises(ValueError, match="tgi with these flags keeps its own order"):
        build_engine(deployment, "tgi:fairness=vtc")


def test_tenant_mix_and_streams():
    from tailserve.core.source import ListSource
    from tailserve.workloads.lengths import Fixed
    from tailserve.workloads.tenants import TenantSource, parse_tenant_mix, parse_tenant_rates, tenant_streams

    assert parse_tenant_mix("a=0.9,b=0.1") == (("a", 0.9), ("b", 0.1))
    for bad, message in [("a=0.9,b=0.2", "sum to 1"), ("a=x", "not TENANT=FRACTION"), ("a=1,a=0", "twice")]:
        with pytest.raises(ValueError, match=message):
            parse_tenant_mix(bad)
    rates = parse_tenant_rates("heavy=10,light=1")
    both = tenant_streams(rates, 30.0, Fixed(100), Fixed(10), seed=3)
    alone = tenant_streams((("light", 1.0),), 30.0, Fixed(100), Fixed(10), seed=3)
    light = [(r.request_id, r.arrival_time) for r in both if r.tenant_id == "light"]
    assert light == [(r.request_id, r.arrival_time) for r in alone]  # the same traffic as alone
    assert 250 < sum(r.tenant_id == "heavy" for r in both) < 350 and 15 < len(light) < 45  # 300, 30 expected
    mixed = TenantSource(
        ListSource([Request(f"r{i}", 10, 1, 0.0) for i in range(1000)]), (("a", 0.9), ("b", 0.1)), 0
    )
    tenants = [r.tenant_id for r in mixed.pop_arrived(0.0)]
    assert 0.85 < tenants.count("a") / 1000 < 0.95


def test_the_tenants_flag_reaches_the_requests():
    from tailserve.cli.app import main

    code = main(["simulate", "--policy", "vllm", "--fairness", "vtc", "--tenants", "a=0.5,b=0.5",
                 "--workload", "random", "--num-requests", "40", "--rate", "50", "--json", "/dev/null"])  # fmt: skip
    assert code == 0
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec

    spec = WorkloadSpec("random", num_requests=200, tenants=(("a", 0.5), ("b", 0.5)))
    source = WorkloadBuilder(spec).build(CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1))
    tenants = [r.tenant_id for r in source.pop_arrived(1e9)]
    assert set(tenants) == {"a", "b"} and 60 < tenants.count("a") < 140


def _recording_inner() -> Policy:
    """A policy whose every hook (``policy_hooks``) records its name, then answers as the
    protocol's default does (``schedule``: an empty output)."""
    calls: list[str] = []

    def recorder(name: str) -> Any:
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            if name == "schedule":
                return SchedulerOutput()
            for protocol in (Policy, FastPaths):
                default = vars(protocol).get(name)
                if callable(default):
                    return default(self, *args, **kwargs)
            return None

        return hook

    body = {name: recorder(name) for name in policy_hooks()}
    body |= {"name": "recorder", "summary": "", "config_cls": object, "calls": calls}
    for name in ("default_config", "default_notes", "profile_tokens", "drafter_memory"):
        body[name] = classmethod(recorder(name))
    recording = type("Recording", (Policy, FastPaths), body)
    return recording(None)


def _arguments(name: str) -> list[Any]:
    """Stand-ins for the parameters of the hook ``name`` as its protocol declares them, by
    parameter name (a mock for any other)."""
    fn = next(vars(p)[name] for p in (Policy, FastPaths, PredictsIterations) if name in vars(p))
    request = Request("r", 100, 10, 0.0, tenant_id="a")
    known = {"request": request, "prompt": request, "finished": [], "now": 0.0, "num_steps": 1, "chunk": 2}
    params = list(inspect.signature(fn).parameters.values())[1:]  # after self
    return [known.get(p.name, mock.MagicMock()) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]


def _unforwarded(wrapper_cls: type) -> list[str]:
    """The hooks of ``policy_hooks`` that ``wrapper_cls`` neither forwards to the wrapped policy
    when called nor declares in ``NOT_FORWARDED``."""
    missing = []
    for name in policy_hooks():
        if name in wrapper_cls.NOT_FORWARDED:
            continue
        inner = _recording_inner()
        wrapper = wrapper_cls(inner, make_backlog("vtc", ""))
        method = getattr(wrapper, name)
        method(*_arguments(name))
        if name not in inner.calls:
            missing.append(name)
    return missing


def test_fair_policy_forwards_every_hook():
    """Every public method of Policy, FastPaths and PredictsIterations reaches the wrapped
    policy through FairPolicy, or is declared off with a reason: a hook added to any of them and
    not forwarded fails here (as the chunk-run hooks were once dropped silently)."""
    hooks = set(policy_hooks())
    for protocol in (Policy, FastPaths):
        public = {n for n, v in inspect.getmembers(protocol) if not n.startswith("_") and callable(v)}
        assert public <= hooks, f"policy_hooks misses {sorted(public - hooks)} of {protocol.__name__}"
    assert "bind_cost_model" in hooks
    assert set(FairPolicy.NOT_FORWARDED) <= hooks, "NOT_FORWARDED names a hook that no longer exists"
    assert all(FairPolicy.NOT_FORWARDED.values()), "each hook left off says why"
    assert _unforwarded(FairPolicy) == []
    # The declarations come from the wrapped policy too.
    fair = FairPolicy(_recording_inner(), make_backlog("vtc", ""))
    assert fair.name == "recorder" and fair.decode_reserve_blocks == 0
    sarathi = POLICIES["sarathi"]
    wrapped = FairPolicy(sarathi(sarathi.default_config(DEVICE, 4096)), make_backlog("vtc", ""))
    assert wrapped.decode_reserve_blocks == 1 and wrapped.summary == sarathi.summary
    assert set(policy_declarations()) >= {"name", "decode_reserve_blocks", "chunk_run_takes_arrivals"}


def test_the_forwarding_check_catches_a_dropped_hook():
    """The check above has teeth: a wrapper that answers a hook itself is caught."""

    class Dropping(FairPolicy):
        def next_wakeup(self, sched: Scheduler, now: float) -> float | None:
            return None

        def on_chunk_run(self, sched: Scheduler, prompt: Request, num_steps: int) -> None:
            return None

    assert _unforwarded(Dropping) == ["next_wakeup", "on_chunk_run"]
