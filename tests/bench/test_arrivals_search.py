"""Arrival processes and the max-rate search: pure functions."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from tandem.bench.arrivals import arrival_times, arrival_times_until, parse_rates
from tandem.bench.search import find_max_rate


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(4, math.inf) == [0.0] * 4


def test_poisson_arrivals_repeat_with_the_seed_and_end_at_n_over_rate():
    a = arrival_times(200, 8.0, seed=1)
    assert a == arrival_times(200, 8.0, seed=1) != arrival_times(200, 8.0, seed=2)
    assert a == sorted(a) and a[0] > 0
    assert a[-1] == pytest.approx(200 / 8.0)
    gaps = np.diff(a)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.25)  # exponential: cv 1


def test_burstiness_shapes_the_gaps():
    def cv(b):
        gaps = np.diff(arrival_times(2000, 10.0, burstiness=b, seed=0))
        return np.std(gaps) / np.mean(gaps)

    assert cv(0.25) > 1.5 > cv(1.0) > 0.7 > cv(4.0)  # gamma: cv = 1 / sqrt(shape)
    assert cv(math.inf) == pytest.approx(0.0, abs=1e-9)


def test_arrivals_for_a_duration():
    t = arrival_times_until(20.0, 5.0, seed=0)
    assert t == arrival_times_until(20.0, 5.0, seed=0)
    assert all(0 < x < 20.0 for x in t) and t == sorted(t)
    assert 70 <= len(t) <= 130


def test_parse_rates():
    assert parse_rates("inf") == [math.inf]
    assert parse_rates("1,2,4.5") == [1.0, 2.0, 4.5]
    with pytest.raises(ValueError):
        parse_rates("0")
    with pytest.raises(ValueError, match="not a list of positive rates"):
        parse_rates("fast")


def search(capacity, **kw):
    """A server whose attainment is 1 up to `capacity` req/s and falls off above it."""
    seen = []

    async def probe(rate):
        seen.append(rate)
        return 1.0 if rate <= capacity else max(0.0, 1 - (rate - capacity) / capacity)

    return asyncio.run(find_max_rate(probe, **kw)), seen


def test_max_rate_search_doubles_then_bisects():
    found, seen = search(6.0, target=0.9, start=1.0, max_probes=12, tolerance=0.05)
    assert seen[:4] == [1.0, 2.0, 4.0, 8.0]  # doubling until a miss
    assert 6.0 <= found.max_rate <= 6.6  # 0.9 attainment is reached at 6.6
    assert found.probes[0] == (1.0, 1.0)


def test_max_rate_search_when_nothing_meets_the_target():
    found, seen = search(0.01, target=0.9, start=1.0, max_probes=4)
    assert found.max_rate is None and seen == [1.0, 0.5, 0.25, 0.125]
