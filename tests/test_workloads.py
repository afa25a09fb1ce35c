"""Arrival processes, length distributions, the closed-loop source and the named workloads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tailserve.core.request import Request
from tailserve.core.source import ListSource
from tailserve.workloads.arrivals import (
    ArrivalSpec,
    ClosedLoopSource,
    constant_arrivals,
    gamma_arrivals,
    parse_arrival,
    poisson_arrivals,
)
from tailserve.workloads.builtin import chat, hol, synthetic
from tailserve.workloads.lengths import Empirical, Fixed, LogNormal, Uniform, parse_length


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def gap_cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


# --- arrivals -------------------------------------------------------------------------------


def test_poisson_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    a = poisson_arrivals(100, 5.0, rng(1))
    assert np.array_equal(a, poisson_arrivals(100, 5.0, rng(1)))
    assert not np.array_equal(a, poisson_arrivals(100, 5.0, rng(2)))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_last_arrival_is_exactly_n_over_rate(burstiness: float) -> None:
    times = gamma_arrivals(500, 8.0, burstiness, rng(3))
    assert len(times) == 500
    assert times[-1] == pytest.approx(500 / 8.0, rel=1e-12)
    assert np.all(np.diff(times) >= 0)
    assert 0 < times[0] < 1.0  # starts near 0: the first gap, not a fixed 0


def test_gamma_matches_vllm_bench_serve_recipe() -> None:
    # vLLM: gaps ~ Gamma(k, 1/(rate*k)) from one generator, cumulated, then rescaled to n/rate.
    gaps = rng(7).gamma(shape=0.5, scale=1.0 / (3.0 * 0.5), size=50)
    expected = np.cumsum(gaps) * (50 / 3.0) / gaps.sum()
    assert np.allclose(gamma_arrivals(50, 3.0, 0.5, rng(7)), expected)


def test_poisson_is_gamma_with_burstiness_one() -> None:
    assert np.array_equal(poisson_arrivals(50, 2.0, rng(4)), gamma_arrivals(50, 2.0, 1.0, rng(4)))


def test_burstiness_moves_the_coefficient_of_variation_the_right_way() -> None:
    bursty = gap_cv(gamma_arrivals(5000, 10.0, 0.25, rng(5)))  # expect ~2
    poisson = gap_cv(gamma_arrivals(5000, 10.0, 1.0, rng(5)))  # expect ~1
    smooth = gap_cv(gamma_arrivals(5000, 10.0, 4.0, rng(5)))  # expect ~0.5
    assert bursty > 1.5 > poisson > 0.8 > 0.65 > smooth
    assert poisson == pytest.approx(1.0, abs=0.1)


def test_constant_arrivals_are_evenly_spaced_from_zero() -> None:
    assert np.allclose(constant_arrivals(4, 2.0), [0.0, 0.5, 1.0, 1.5])


def test_infinite_rate_sends_everything_at_once() -> None:
    assert np.array_equal(gamma_arrivals(5, math.inf, 0.5, rng()), np.zeros(5))
    assert np.array_equal(constant_arrivals(3, math.inf), np.zeros(3))


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_bad_rate_is_rejected_naming_the_value(rate: float) -> None:
    with pytest.raises(ValueError, match=str(rate)):
        poisson_arrivals(10, rate, rng())
    with pytest.raises(ValueError, match=str(rate)):
        constant_arrivals(10, rate)


@pytest.mark.parametrize("burstiness", [0.0, -2.0])
def test_bad_burstiness_is_rejected_naming_the_value(burstiness: float) -> None:
    with pytest.raises(ValueError, match=str(burstiness)):
        gamma_arrivals(10, 1.0, burstiness, rng())


def test_zero_arrivals_is_an_empty_array() -> None:
    assert len(poisson_arrivals(0, 1.0, rng())) == 0


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("poisson", ArrivalSpec("poisson")),
        ("gamma:0.5", ArrivalSpec("gamma", burstiness=0.5)),
        ("constant", ArrivalSpec("constant")),
        ("closed:8", ArrivalSpec("closed", concurrency=8)),
    ],
)
def test_parse_arrival_accepts_the_cli_forms(text: str, spec: ArrivalSpec) -> None:
    assert parse_arrival(text) == spec
    assert str(spec) == text
    assert spec.is_closed_loop == text.startswith("closed")


@pytest.mark.parametrize(
    "text", ["", "gamma", "gamma:x", "gamma:0", "closed", "closed:0", "closed:1.5", "poisson:2"]
)
def test_parse_arrival_rejects_bad_forms(text: str) -> None:
    with pytest.raises(ValueError):
        parse_arrival(text)


def test_arrival_spec_times_follow_its_kind() -> None:
    assert np.allclose(ArrivalSpec("constant").times(3, 1.0, rng()), [0.0, 1.0, 2.0])
    gamma = ArrivalSpec("gamma", burstiness=0.5).times(20, 2.0, rng(9))
    assert np.array_equal(gamma, gamma_arrivals(20, 2.0, 0.5, rng(9)))
    with pytest.raises(ValueError):
        ArrivalSpec("closed", concurrency=2).times(3, 1.0, rng())


# --- closed loop ----------------------------------------------------------------------------


def make_requests(n: int) -> list[Request]:
    return [Request(f"r{i}", 10, 5, 99.0) for i in range(n)]


def test_closed_loop_keeps_exactly_c_outstanding() -> None:
    source = ClosedLoopSource(make_requests(10), concurrency=3)
    assert source.next_arrival_time() == 0.0
    in_flight = source.pop_arrived(0.0)
    assert [r.request_id for r in in_flight] == ["r0", "r1", "r2"]
    assert all(r.arrival_time == 0.0 for r in in_flight)
    assert source.next_arrival_time() is None  # nothing more until something finishes
    assert source.pop_arrived(100.0) == []

    now = 0.0
    finished = 0
    while in_flight:
        now += 1.0
        done = in_flight.pop(0)
        source.on_finish(done, now)
        finished += 1
        assert source.next_arrival_time() == (now if finished <= 7 else None)
        arrived = source.pop_arrived(now)
        assert all(r.arrival_time == now for r in arrived)
        in_flight.extend(arrived)
        assert len(in_flight) == min(3, 10 - finished)
        assert source.num_outstanding == len(in_flight)
        assert source.exhausted == (finished >= 7)
    assert finished == 10


def test_closed_loop_ignores_finishes_it_did_not_cause() -> None:
    source = ClosedLoopSource(make_requests(5), concurrency=2)
    first = source.pop_arrived(0.0)
    source.on_finish(Request("stranger", 1, 1, 0.0), 1.0)
    assert source.next_arrival_time() is None
    source.on_finish(first[0], 2.0)
    source.on_finish(first[0], 3.0)  # a second call for the same request releases nothing
    assert [r.arrival_time for r in source.pop_arrived(10.0)] == [2.0]


def test_closed_loop_with_more_concurrency_than_requests() -> None:
    source = ClosedLoopSource(make_requests(2), concurrency=5)
    assert len(source.pop_arrived(0.0)) == 2
    assert source.exhausted


def test_closed_loop_rejects_zero_concurrency() -> None:
    with pytest.raises(ValueError, match="0"):
        ClosedLoopSource(make_requests(2), concurrency=0)


# --- lengths --------------------------------------------------------------------------------


def test_fixed_and_uniform_samples() -> None:
    assert np.array_equal(Fixed(7).sample(3, rng()), [7, 7, 7])
    values = Uniform(3, 5).sample(2000, rng())
    assert set(values.tolist()) == {3, 4, 5}  # both ends inclusive


def test_lognormal_has_the_requested_mean_and_respects_the_cap() -> None:
    values = LogNormal(512, 0.8).sample(50_000, rng())
    assert values.dtype.kind == "i"
    assert values.mean() == pytest.approx(512, rel=0.03)
    capped = LogNormal(512, 0.8, max_value=600).sample(5000, rng())
    assert capped.max() == 600 and capped.min() >= 1
    assert LogNormal(1, 3.0).sample(5000, rng()).min() == 1  # tiny values clip up to 1


def test_empirical_resamples_only_observed_values() -> None:
    dist = Empirical([5, 9])
    assert dist.values == (5, 9)
    assert set(dist.sample(100, rng()).tolist()) == {5, 9}


@pytest.mark.parametrize(
    "make",
    [
        lambda: Fixed(0),
        lambda: Uniform(0, 5),
        lambda: Uniform(10, 5),
        lambda: LogNormal(0, 1),
        lambda: LogNormal(10, -1),
        lambda: LogNormal(10, 1, max_value=0),
        lambda: Empirical([]),
        lambda: Empirical([3, 0]),
    ],
)
def test_length_constructors_validate(make) -> None:
    with pytest.raises(ValueError):
        make()


def test_length_samples_are_deterministic_for_a_seed() -> None:
    dist = LogNormal(300, 0.8, max_value=2048)
    assert np.array_equal(dist.sample(100, rng(3)), dist.sample(100, rng(3)))


@pytest.mark.parametrize(
    ("text", "dist"),
    [
        ("512", Fixed(512)),
        ("fixed:512", Fixed(512)),
        ("uniform:128:1024", Uniform(128, 1024)),
        ("lognormal:mean=512,sigma=0.8", LogNormal(512, 0.8)),
        ("lognormal:mean=512,sigma=0.8,max=4096", LogNormal(512, 0.8, 4096)),
        ("lognormal:sigma=0.5,mean=100", LogNormal(100, 0.5)),
    ],
)
def test_parse_length_accepts_the_cli_forms(text: str, dist: object) -> None:
    assert parse_length(text) == dist


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "-5",
        "0",
        "fixed:",
        "fixed:1.5",
        "uniform:128",
        "uniform:1024:128",
        "lognormal:mean=512",
        "lognormal:mean=512,sigma=0.8,bogus=1",
        "lognormal:mean=x,sigma=1",
        "normal:5",
    ],
)
def test_parse_length_rejects_and_lists_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="accepted forms: N, fixed:N, uniform:LOW:HIGH"):
        parse_length(text)


# --- named workloads ------------------------------------------------------------------------


def test_hol_shape() -> None:
    requests = hol(long_arrival_time=1.5)
    shorts, long = requests[:10], requests[10]
    assert [r.request_id for r in shorts] == [f"short-{i}" for i in range(10)]
    assert all((r.prompt_len, r.max_tokens, r.arrival_time) == (512, 256, 0.0) for r in shorts)
    assert (long.request_id, long.prompt_len, long.max_tokens) == ("long-0", 8192, 256)
    assert long.arrival_time == 1.5
    with pytest.raises(ValueError, match="-1"):
        hol(-1.0)


def summary(requests: list[Request]) -> list[tuple[str, int, int, float]]:
    return [(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time) for r in requests]


def test_chat_is_deterministic_and_has_the_described_mix() -> None:
    requests = chat(num_requests=2000, rate=4.0, seed=1)
    assert summary(requests) == summary(chat(num_requests=2000, rate=4.0, seed=1))
    assert summary(requests) != summary(chat(num_requests=2000, rate=4.0, seed=2))
    assert len(requests) == 2000
    arrivals = [r.arrival_time for r in requests]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] == pytest.approx(2000 / 4.0)
    long = [r for r in requests if r.prompt_len > 2048]
    assert 0.07 < len(long) / 2000 < 0.13
    assert all(4096 <= r.prompt_len <= 8000 for r in long)
    short = [r for r in requests if r.prompt_len <= 2048]
    assert np.mean([r.prompt_len for r in short]) == pytest.approx(300, rel=0.15)
    assert max(r.max_tokens for r in requests) <= 1024
    assert min(min(r.prompt_len, r.max_tokens) for r in requests) >= 1


def test_synthetic_open_loop_gives_a_list_source_in_arrival_order() -> None:
    source = synthetic(50, 10.0, Fixed(100), Uniform(1, 20), ArrivalSpec("poisson"), seed=0)
    assert isinstance(source, ListSource)
    requests = source.pop_arrived(math.inf)
    assert len(requests) == 50 and source.exhausted
    assert all(r.prompt_len == 100 and 1 <= r.max_tokens <= 20 for r in requests)
    assert requests[-1].arrival_time == pytest.approx(5.0)


def test_synthetic_is_deterministic_and_lengths_do_not_depend_on_arrivals() -> None:
    def lengths(arrival: str, seed: int) -> list[tuple[int, int, float]]:
        source = synthetic(
            30, 5.0, parse_length("uniform:1:1000"), LogNormal(50, 1), parse_arrival(arrival), seed
        )
        return [(r.prompt_len, r.max_tokens, r.arrival_time) for r in source.pop_arrived(1e9)]

    assert lengths("gamma:0.5", 3) == lengths("gamma:0.5", 3)
    assert lengths("gamma:0.5", 3) != lengths("gamma:0.5", 4)
    poisson = [(p, o) for p, o, _ in lengths("poisson", 3)]
    assert [(p, o) for p, o, _ in lengths("constant", 3)] == poisson


def test_synthetic_closed_loop_gives_a_closed_loop_source() -> None:
    source = synthetic(10, 1.0, Fixed(10), Fixed(10), parse_arrival("closed:4"), seed=0)
    assert isinstance(source, ClosedLoopSource)
    assert len(source.pop_arrived(0.0)) == 4
