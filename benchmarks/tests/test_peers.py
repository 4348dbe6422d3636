"""The peer benchmark's pieces that need no peer: the median's interval (`benchlib.peers`)."""

from __future__ import annotations

import math

from benchlib.peers import median_interval


def test_median_interval_takes_the_binomial_ranks_of_the_order_statistics():
    # n = 10: P(B <= 1) = 0.011 <= 0.025 < P(B <= 2), so the 95% interval is [x_(2), x_(9)]; n = 30: [x_(10), x_(21)]
    assert median_interval(range(1, 11)) == (5.5, 2, 9)
    assert median_interval(range(1, 31)) == (15.5, 10, 21)


def test_median_interval_of_too_few_values_is_their_range():
    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)  # n = 3: no pair of ranks covers 95%
    assert all(math.isnan(x) for x in median_interval([]))
