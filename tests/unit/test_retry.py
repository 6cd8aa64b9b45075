"""The one backoff formula, and the retry loops that use it."""

from __future__ import annotations

import pytest

from libludic.distributed.publisher import RetryPolicy
from libludic.retry import Backoff


def test_backoff_doubles_from_its_base_up_to_its_cap() -> None:
    b = Backoff(0.5, 3.0)
    # 0.5 * 2**a: 0.5, 1, 2, then 4 capped at 3; a negative attempt counts as the first
    assert [b.delay(a) for a in (-1, 0, 1, 2, 3, 1000)] == [0.5, 0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="base_s <= cap_s"):
        Backoff(2.0, 1.0)
    with pytest.raises(ValueError, match="0 <= base_s"):
        Backoff(-1.0, 1.0)


def test_the_publishers_policy_counts_attempts_from_one() -> None:
    p = RetryPolicy(backoff_s=0.5, backoff_cap_s=10.0)
    # after attempt 1 (the first) wait backoff_s, after attempt 2 twice that
    assert [p.delay(a) for a in (1, 2, 3, 6)] == [0.5, 1.0, 2.0, 10.0]
    with pytest.raises(ValueError, match="base_s <= cap_s"):
        RetryPolicy(backoff_s=5.0, backoff_cap_s=1.0)
