"""``ludic status [--json]``: stream depths, pending entries, consumers, versions, actors.

Per stream: length (un-acked backlog: consumers XDEL on ack), the consumer group's
pending count and lag, and each consumer's pending count and idle time. Also the
dead-letter count (XLEN of ``deadletter``) with its reasons, the run accounting
(libludic/transport/accounting.py: groups requested = trained + dropped + dead-lettered + in flight,
items trained twice), the learner's
``policy_version`` and ``learner_step``, the credit leader, the live actors (heartbeat
keys that have not expired) and the live learner's publish record (served version, failed
publishes, the last error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections import Counter
from typing import Any

from libludic import transport
from libludic.transport import accounting
from services.common.settings import redact_url, secret_from_file

LEARNER_FIELDS = (
    "step",
    "policy_version",
    "publish_failures",
    "consecutive_publish_failures",
    "last_publish_error",
    "replicas",
)


def _s(x: Any) -> Any:
    return x.decode() if isinstance(x, bytes) else x


async def collect(redis_url: str, run_id: str, deadletter_sample: int = 1000) -> dict[str, Any]:
    keys = transport.Keys(run_id)
    r = transport.connect(redis_url)
    try:
        streams = {
            name: await transport.stream_info(r, key) for name, key in keys.streams().items()
        }
        reasons = Counter(
            await transport.recent_fields(r, keys.deadletter, b"reason", deadletter_sample)
        )
        lease = await r.get(keys.lease("credit"))
        actors = await transport.alive(r, keys, "actor")
        learners = await transport.alive(r, keys, "learner")
        return {
            "run_id": run_id,
            "streams": streams,
            "deadletter": {
                "count": streams["deadletter"]["length"],
                "recent_reasons": dict(reasons),
            },
            "policy_version": await transport.get_int(r, keys.policy_version),
            "learner_step": await transport.get_int(r, keys.learner_step),
            "feeder_next_seed": await transport.get_int(r, keys.feeder_seed),
            "credit_leader": _s(lease),
            "accounting": await accounting.snapshot(r, keys),
            "actors_alive": len(actors),
            # what the live learner says of its publishes (served = the last acknowledged)
            "learner": {k: {kk: v.get(kk) for kk in LEARNER_FIELDS} for k, v in learners.items()},
            "actors": {
                k: {
                    kk: vv
                    for kk, vv in v.items()
                    if kk in ("pid", "host", "inflight", "episodes", "ts")
                }
                for k, v in actors.items()
            },
        }
    finally:
        await r.aclose()


def render(st: dict[str, Any]) -> str:
    lines = [
        f"run {st['run_id']}: policy_version={st['policy_version']} learner_step={st['learner_step']} "
        f"actors_alive={st['actors_alive']} credit_leader={st['credit_leader'] or '-'} "
        f"deadletter={st['deadletter']['count']}",
        f"{'stream':<11} {'length':>7} {'group':<8} {'pending':>7} {'lag':>5}  consumers (pending/idle s)",
    ]
    for name, info in st["streams"].items():
        groups = info["groups"] or [{"name": "-", "pending": 0, "lag": None, "consumers": []}]
        for g in groups:
            cons = ", ".join(
                f"{c['name']}({c['pending']}/{c['idle_ms'] / 1000:.1f})" for c in g["consumers"]
            )
            lag = "-" if g["lag"] is None else str(g["lag"])
            lines.append(
                f"{name:<11} {info['length']:>7} {g['name']:<8} {g['pending']:>7} {lag:>5}  {cons or '-'}"
            )
    lines.append(accounting.format_line(st.get("accounting")))
    for name, info in (st.get("learner") or {}).items():
        err = info.get("last_publish_error")
        lines.append(
            f"learner {name}: step {info.get('step')}, served version {info.get('policy_version')}, "
            f"publish failures {info.get('publish_failures')}"
            + (f" (last: {str(err)[:200]})" if err else "")
        )
    if st["deadletter"]["recent_reasons"]:
        lines.append(
            "deadletter reasons: "
            + ", ".join(f"{k}={v}" for k, v in sorted(st["deadletter"]["recent_reasons"].items()))
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ludic status", description=__doc__.split("\n")[0])
    p.add_argument(
        "--redis-url", default=os.environ.get("LUDIC_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    # a mounted Secret (compose's `status` service: the admin's URL), as the services read theirs
    p.add_argument(
        "--redis-url-file",
        default=os.environ.get("LUDIC_REDIS_URL_FILE"),
        help="file holding the Redis URL (instead of --redis-url)",
    )
    p.add_argument("--run-id", default=os.environ.get("LUDIC_RUN_ID", "default"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    try:
        if a.redis_url_file:  # it wins over the default of --redis-url
            a.redis_url = secret_from_file(None, a.redis_url_file, "--redis-url", "redis_url")
    except ValueError as e:
        print(f"ludic status: {e}", flush=True)
        return 2
    try:
        st = asyncio.run(collect(a.redis_url, a.run_id))
    except transport.REDIS_DOWN_ERRORS as e:
        print(f"ludic status: cannot reach Redis at {redact_url(a.redis_url)}: {e}", flush=True)
        return 1
    print(json.dumps(st, indent=2, sort_keys=True) if a.json else render(st))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
