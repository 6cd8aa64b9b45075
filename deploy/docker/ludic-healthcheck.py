#!/usr/bin/env python3
"""Container health probe for every `ludic <service>` process (Docker HEALTHCHECK, compose).

Which endpoint is probed follows DEVELOPERS.md: `inference` answers `GET /health` on its API
port 8000 (200 only once the engine answers a real probe); the other services answer
`GET /health` on their metrics port (actor 9101, credit 9102, learner 9103, feeder 9104,
eval 9105) with their own check (the actor's and credit's loop ticked recently, the learner
made progress or waited for items within `health_stall_s`, ...). The service is read from PID 1's command
line (the container's `ludic <service> ...` or `torchrun ... -m services.cli learner`), so
one image and one HEALTHCHECK serve all six services. `HEALTHCHECK_URL` overrides the probed URL.

Exit 0 = healthy, 1 = unhealthy (the Docker contract). Standard library only.
"""

from __future__ import annotations

import os
import sys
import urllib.request

# service -> probed path on 127.0.0.1 (ports from DEVELOPERS.md "Services, ports and environment")
PROBES = {
    "inference": "http://127.0.0.1:8000/health",
    "actor": "http://127.0.0.1:9101/health",
    "credit": "http://127.0.0.1:9102/health",
    "learner": "http://127.0.0.1:9103/health",
    "feeder": "http://127.0.0.1:9104/health",
    "eval": "http://127.0.0.1:9105/health",
}


def probe_url() -> str | None:
    override = os.environ.get("HEALTHCHECK_URL")
    if override:
        return override
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    for arg in argv:
        if arg in PROBES:
            return PROBES[arg]
    return None


def main() -> int:
    url = probe_url()
    if url is None:
        # Not a long-running service (e.g. `ludic model init`): nothing to probe.
        return 0
    try:
        with urllib.request.urlopen(url, timeout=4) as resp:  # noqa: S310 (loopback only)
            return 0 if resp.status == 200 else 1
    except Exception as e:  # any failure is "unhealthy"; the reason goes to `docker inspect`
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
