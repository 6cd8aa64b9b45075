"""The health watchdog of `ludic up` (``up.watchdog_timeout_s``): is a live service stuck?

A ``HealthWatch`` polls one service's health URL (``probes.check``: an HTTP endpoint, or a
Redis PING for redis-server) from a daemon thread, so a probe that hangs never holds up the
supervisor's loop. A probe *passes* on a 200 answered within ``timeout_s``; anything else
(another status, a refused connection, no answer in time) fails. Until its first pass a
service is probed every ``STARTING_INTERVAL_S`` at most, and ``first_pass`` is when that
probe answered: the moment a restarted service came back, which the supervisor reports as
its recovery time. The watch is armed by its first pass: a service still starting (vLLM
loading and compiling, a learner resuming a checkpoint) is never stuck. Once armed::

    stuck  <=>  every probe started since t_f failed, at least one has, and now - t_f >= timeout_s

where t_f is the start of the first failing probe after the last pass. A probe may take
up to ``timeout_s`` itself: a slow answer is an answer. So a service whose endpoint stops
answering is stuck at most ``interval_s + timeout_s`` later, and one that answers 200
within ``timeout_s`` at least once per ``timeout_s`` never is. ``Supervisor`` reads the
verdict and kills the service (supervisor.py).

A watch may also have a start-up deadline (``startup_s``, the supervisor's for restarted
services): a service that has not passed one probe ``startup_s`` after its watch began is
stuck too (a restart that never comes up: a learner hanging while it loads its checkpoint,
an inference server whose engine never starts). Without one, an unarmed watch never fires.
"""

from __future__ import annotations

import threading
import time

from services.common.settings import redact_url
from services.launcher import probes

STARTING_INTERVAL_S = 0.5


class HealthWatch:
    def __init__(
        self, url: str, interval_s: float, timeout_s: float, startup_s: float | None = None
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0 or (startup_s is not None and startup_s <= 0):
            raise ValueError(
                f"HealthWatch({url}) needs interval_s > 0, timeout_s > 0 and startup_s None or "
                f"> 0, got {interval_s}, {timeout_s} and {startup_s}"
            )
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self.began = time.monotonic()
        self.passes = 0  # probes that answered 200
        self.first_pass: float | None = None  # when the first of them answered (monotonic)
        self.failing_since: float | None = None  # t_f, None while the last probe passed
        self.last_error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._poll, name=f"watchdog {redact_url(url)}", daemon=True
        )

    def start(self) -> HealthWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The thread ends after the probe in flight (if any), whose result is dropped."""
        self._stop.set()

    def stuck_for(self, now: float) -> float | None:
        """Seconds the armed service has been failing when that is ``timeout_s`` or more,
        or seconds an unarmed one has been starting when that is ``startup_s`` or more;
        else None."""
        with self._lock:
            if not self.passes:
                if self.startup_s is not None and now - self.began >= self.startup_s:
                    return now - self.began
                return None
            if self.failing_since is None:
                return None
            failing = now - self.failing_since
        return failing if failing >= self.timeout_s else None

    def _poll(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            error = self._probe()
            with self._lock:
                if self._stop.is_set():
                    return
                if error is None:
                    self.passes += 1
                    if self.first_pass is None:  # the end of the probe: when it served
                        self.first_pass = time.monotonic()
                    self.failing_since = None
                else:
                    self.last_error = error
                    if self.failing_since is None:
                        self.failing_since = t
            # a starting service is probed often (every STARTING_INTERVAL_S at most): its
            # first pass is when it came up (a restart's recovery time, supervisor.py)
            self._stop.wait(
                self.interval_s if self.passes else min(self.interval_s, STARTING_INTERVAL_S)
            )

    def _probe(self) -> str | None:
        """None on a pass, else why not (with the launcher's one kept client)."""
        return probes.check(self.url, self.timeout_s)
