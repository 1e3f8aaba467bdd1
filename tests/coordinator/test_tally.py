"""The request path's tallies publish exactly what direct prometheus_client calls would."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from motor_mesh.coordinator.tally import Tallies

BUCKETS = (0.001, 0.01, 0.1, 1.0)


@given(st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), max_size=50), st.integers(0, 20))
def test_flushed_tallies_match_direct_observations(values: list[float], count: int) -> None:
    direct, tallied = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "h", ["x"], buckets=BUCKETS, registry=direct).labels("a")
    c1 = Counter("c", "c", registry=direct)
    h2 = Histogram("h", "h", ["x"], buckets=BUCKETS, registry=tallied)
    c2 = Counter("c", "c", registry=tallied)
    tallies = Tallies()
    ht = tallies.histogram(lambda: h2.labels("a"), BUCKETS)
    ct = tallies.counter(lambda: c2)
    for v in values:
        h1.observe(v)
        ht.observe(v)
    c1.inc(count)
    ct.n += count
    tallies.flush()
    tallies.flush()  # a second flush adds nothing

    def text(r: CollectorRegistry) -> list[str]:
        # _created timestamps differ between the two registries; every value must not.
        return [ln for ln in generate_latest(r).decode().splitlines() if "_created" not in ln]

    assert text(tallied) == text(direct)
