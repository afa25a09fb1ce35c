"""``RequestSource.horizon``: every source declares it (the exact fast paths read it directly),
None except a cluster replica's, which reports the cluster's next event."""

from __future__ import annotations

from tailserve.bench.predict import GatedSource
from tailserve.cluster.replica import FeedSource
from tailserve.core.request import Request
from tailserve.core.source import ListSource, QueueSource
from tailserve.core.stream_source import IteratorSource
from tailserve.workloads.arrivals import ClosedLoopSource
from tailserve.workloads.mix_source import MixSource


def _requests() -> list[Request]:
    return [Request(f"r{i}", prompt_len=8, max_tokens=2, arrival_time=0.1 * i) for i in range(3)]


def test_every_source_declares_a_horizon_and_only_a_replica_sets_one():
    sources = [
        ListSource(_requests()),
        QueueSource(),
        IteratorSource(_requests()),
        ClosedLoopSource(_requests(), 2),
        MixSource(ListSource(_requests()), "priority", ((0, 0.5), (1, 0.5)), seed=0),
        GatedSource(_requests(), 2),
        FeedSource(),
    ]
    assert [s.horizon for s in sources] == [None] * len(sources)
    feed = sources[-1]
    feed.add(_requests()[2], 0.2)
    feed.horizon = 0.15  # the cluster's next event comes before the next release
    assert feed.next_arrival_time() == 0.15
    feed.horizon = None  # draining: only the releases count
    assert feed.next_arrival_time() == 0.2
