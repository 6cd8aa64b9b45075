"""``ludic feeder``: keeps the requests stream topped up from a curriculum config.

See services/feeder/README.md. Each tick: ``n = high_water - XLEN(requests)`` (nothing
when the backlog is at the mark: backpressure); reserve ``n`` seeds with one
``INCRBY ludic:{run}:feeder:seed n`` (atomic, persisted: restarts and parallel feeders
never reuse a seed); for seed ``s`` pick task ``tasks[pick(s)]`` (weighted, a pure
function of the seed) and XADD one RolloutRequest with ``num_episodes=algorithm.group_size``,
``same_env_seed=True``, ``env_seed=s``, ``meta.group_id = request id = "{run_id}-{s}"``.
A crash between INCRBY and XADD skips seeds, never repeats them; the XADDs run in one
script with a ``done:feeder:{id}`` marker per request and the run accounting's
``groups_requested`` count (libludic/transport/accounting.py), so a retried top-up adds nothing twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from libludic import transport
from libludic.inference.request import InferenceSpec, ReturnSpec
from libludic.rollout.request import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.transport import accounting
from services.common.lifecycle import sleep_or_stop, update_stream_gauges
from services.common.settings import (
    algorithm_group_size,
)
from services.common.skeleton import service_main, serving

log = logging.getLogger("ludic.feeder")

REQUESTS = Counter("ludic_feeder_requests_total", "RolloutRequests added", ["task"])
FULL = Counter("ludic_feeder_backpressure_waits_total", "Ticks skipped: requests stream full")
ERRORS = Counter("ludic_feeder_errors_total", "Feeder failures by kind", ["kind"])


@dataclass
class Task:
    """One curriculum entry: what to run and how often (relative ``weight``)."""

    name: str
    env: EnvSpec
    protocol: ProtocolSpec
    inference: InferenceSpec | None
    weight: float = 1.0

    KEYS = ("name", "env", "protocol", "agent", "inference", "weight")

    @classmethod
    def from_dict(cls, d: dict[str, Any], i: int) -> Task:
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"feeder task #{i}: unknown key(s) {unknown}; valid keys: {list(cls.KEYS)}")
        if "env" not in d or "kind" not in (d["env"] or {}):
            raise ValueError(f"feeder task #{i} needs env: {{kind: ..., kwargs: {{...}}}}; got {d!r}")
        w = float(d.get("weight", 1.0))
        if w <= 0:
            raise ValueError(f"feeder task #{i} weight={w} must be > 0")
        inf = d.get("inference")
        if inf is not None and "return_spec" not in inf:
            # training needs token ids + logprobs; InferenceSpec.from_dict would default to none
            inf = {**inf, "return_spec": ReturnSpec.for_rl().to_dict()}
        proto = dict(d.get("protocol") or {"kind": "single_agent"})
        if d.get("agent") is not None:
            if proto.get("agent") is not None:
                raise ValueError(f"feeder task #{i} sets agent twice (task agent: and protocol.agent:); keep one")
            proto["agent"] = d["agent"]
        try:
            protocol = ProtocolSpec.from_dict(proto)
        except ValueError as e:
            raise ValueError(f"feeder task #{i} ({d.get('name') or d['env']['kind']}): {e}") from e
        return cls(
            name=str(d.get("name") or d["env"]["kind"]),
            env=EnvSpec.from_dict(d["env"]),
            protocol=protocol,
            inference=None if inf is None else InferenceSpec.from_dict(inf),
            weight=w,
        )


@dataclass
class FeederSettings:
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis URL"})
    run_id: str = field(default="default", metadata={"help": "run namespace of the Redis keys"})
    tasks: list[dict[str, Any]] = field(
        default_factory=lambda: [{"env": {"kind": "arithmetic", "kwargs": {}}}],
        metadata={"help": "curriculum: list of {name, env, protocol, agent, inference, weight} (YAML)"},
    )
    algorithm: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the run's top-level algorithm: section; its group_size = episodes per "
            "request (one group)"
        },
    )
    high_water: int = field(default=64, metadata={"help": "target backlog of the requests stream"})
    max_requests: int = field(default=0, metadata={"help": "stop after this many (0: forever)"})
    poll_s: float = field(default=0.5, metadata={"help": "seconds between top-ups"})
    metrics_port: int = field(default=9104, metadata={"help": "/metrics and /health (0 off)"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})

    def __post_init__(self) -> None:
        self.group_size = algorithm_group_size(self.algorithm)
        if self.high_water < 1:
            raise ValueError(f"feeder high_water={self.high_water} must be >= 1")
        if not self.tasks:
            raise ValueError("feeder needs at least one task; see services/feeder/README.md")
        self.parsed_tasks = [Task.from_dict(d, i) for i, d in enumerate(self.tasks)]


def pick_task(tasks: list[Task], seed: int) -> Task:
    """Weighted choice that is a pure function of ``seed`` (same seed, same task)."""
    if len(tasks) == 1:
        return tasks[0]
    h = int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=8).digest(), "big")
    x = (h / 2**64) * sum(t.weight for t in tasks)
    for t in tasks:
        x -= t.weight
        if x < 0:
            return t
    return tasks[-1]


def make_request(settings: FeederSettings, task: Task, seed: int) -> RolloutRequest:
    rid = f"{settings.run_id}-{seed}"
    return RolloutRequest(
        id=rid,
        env=task.env,
        protocol=task.protocol,
        env_seed=seed,
        sampling_seed=seed * 1000,
        inference=task.inference,
        num_episodes=settings.group_size,
        same_env_seed=True,
        meta={"group_id": rid, "task": task.name},
    )


async def top_up(r: Any, keys: transport.Keys, settings: FeederSettings, limit: int) -> int:
    """Add requests until the backlog reaches ``high_water`` (at most ``limit``)."""
    n = min(settings.high_water - await transport.backlog(r, keys.requests), limit)
    if n <= 0:
        return 0
    last = int(await r.incrby(keys.feeder_seed, n))
    batch, tasks = [], []
    for seed in range(last - n, last):
        task = pick_task(settings.parsed_tasks, seed)
        req = make_request(settings, task, seed)
        batch.append((req.id, transport.encode_request(req)))
        tasks.append(task.name)
    await accounting.add_requests(r, keys, batch)  # XADD + groups_requested, atomically
    for name in tasks:
        REQUESTS.labels(task=name).inc()
    return n


async def run(settings: FeederSettings, *, stop: asyncio.Event | None = None) -> int:
    """Feed until ``stop`` (or ``max_requests``). Returns the number of requests added."""
    stop = stop or asyncio.Event()
    keys = transport.Keys(settings.run_id)
    added, attempt = 0, 0
    async with serving(settings.redis_url, settings.metrics_port) as (r, _):
        while not stop.is_set():
            limit = settings.max_requests - added if settings.max_requests > 0 else 1 << 30
            if limit <= 0:
                break
            try:
                n = await top_up(r, keys, settings, limit)
                await update_stream_gauges(r, keys)
                attempt = 0
            except transport.REDIS_DOWN_ERRORS as e:
                ERRORS.labels(kind="redis").inc()
                log.warning("redis unavailable (%s); backing off", e)
                await transport.backoff_sleep(attempt, stop)
                attempt += 1
                continue
            added += n
            if n == 0:
                FULL.inc()
            await sleep_or_stop(stop, settings.poll_s)
    log.info("feeder added %d request(s)", added)
    return added


def main(argv: list[str] | None = None) -> int:
    return service_main("feeder", FeederSettings, run, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
