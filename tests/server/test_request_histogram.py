"""The request histograms count by bisection what aioprometheus's own observe counts."""

from __future__ import annotations

import random

from aioprometheus import Histogram, Registry

from tokenspeed_aio.server.metrics import NO_LABELS, TPOT_BUCKETS, RequestHistogram


def test_a_request_histogram_publishes_what_aioprometheus_would_count():
    registry = Registry()
    direct = Histogram("direct", "d", registry=registry, buckets=TPOT_BUCKETS)
    fast = RequestHistogram(Histogram("fast", "f", registry=registry, buckets=TPOT_BUCKETS))
    rng = random.Random(3)
    # every bound exactly (a bucket is `value <= bound`), zero, past the last bound, random
    values = [*TPOT_BUCKETS, 0.0, 1e9, *(rng.uniform(0, 3) for _ in range(500))]
    for v in values:
        direct.observe(NO_LABELS, v)
        fast.observe(v)
    fast.publish()
    assert fast.metric.get(NO_LABELS) == direct.get(NO_LABELS)
    assert direct.get(NO_LABELS)["count"] == len(values)


def test_an_unobserved_request_histogram_publishes_no_series():
    fast = RequestHistogram(Histogram("h", "h", registry=Registry(), buckets=TPOT_BUCKETS))
    fast.publish()
    assert not fast.metric.get_all()
