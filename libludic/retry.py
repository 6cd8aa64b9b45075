"""One retry policy: exponential backoff with a cap.

Every retry loop waits ``Backoff.delay(attempt)`` before its next attempt: Redis calls
(``libludic.transport.backoff_sleep``), the inference client's HTTP retries, the learner's
weight publishes (``libludic.distributed.publisher.RetryPolicy``) and the launcher's service
restarts. Each keeps its own base and cap (a Redis blip is retried within 0.1 s, a crashed
service is restarted after seconds); the formula is this one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """``delay(attempt) = min(cap_s, base_s * 2**attempt)``: attempt 0 waits ``base_s``."""

    base_s: float
    cap_s: float

    def __post_init__(self) -> None:
        if not self.base_s >= 0 or not self.cap_s >= self.base_s:
            raise ValueError(
                f"Backoff(base_s={self.base_s}, cap_s={self.cap_s}): need 0 <= base_s <= cap_s"
            )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (0-based)."""
        return float(min(self.cap_s, self.base_s * 2.0 ** min(max(attempt, 0), 60)))
