"""The feeder's worker: settings, the curriculum (``Task``), request building and one
top-up of the requests stream under admission control. ``main.py`` wires it into a process
(see its docstring for the loop)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from libludic import staleness, transport
from libludic.agents.config import validate_agent_config
from libludic.inference.request import InferenceSpec, ReturnSpec
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.transport import accounting
from services.common.settings import (
    algorithm_group_size,
)

log = logging.getLogger("ludic.feeder")

REQUESTS = Counter("ludic_feeder_requests_total", "RolloutRequests added", ["task"])
FULL = Counter("ludic_feeder_backpressure_waits_total", "Ticks skipped: requests stream full")
NO_ROOM = Counter(
    "ludic_feeder_admission_waits_total",
    "Ticks that added nothing because the learner had no room (max_head_offpolicyness)",
)
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
            raise ValueError(
                f"feeder task #{i}: unknown key(s) {unknown}; valid keys: {list(cls.KEYS)}"
            )
        if "env" not in d or "kind" not in (d["env"] or {}):
            raise ValueError(
                f"feeder task #{i} needs env: {{kind: ..., kwargs: {{...}}}}; got {d!r}"
            )
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
                raise ValueError(
                    f"feeder task #{i} sets agent twice (task agent: and protocol.agent:); keep one"
                )
            proto["agent"] = d["agent"]
        try:
            protocol = ProtocolSpec.from_dict(proto)
            if protocol.agent is not None:
                validate_agent_config(protocol.agent.kind, protocol.agent.kwargs)
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
        metadata={
            "help": "curriculum: list of {name, env, protocol, agent, inference, weight} (YAML)"
        },
    )
    algorithm: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the run's top-level algorithm: section; its group_size = episodes per "
            "request (one group)"
        },
    )
    high_water: int = field(default=64, metadata={"help": "target backlog of the requests stream"})
    max_head_offpolicyness: int | None = field(
        default=staleness.DEFAULT_MAX_HEAD_OFFPOLICYNESS,
        metadata={
            "help": "admission bound (top-level key): generate at most this many learner "
            "batches ahead of the served weights (0 synchronous, null off); see "
            "libludic/staleness.py"
        },
    )
    max_requests: int = field(default=0, metadata={"help": "stop after this many (0: forever)"})
    poll_s: float = field(default=0.5, metadata={"help": "seconds between top-ups"})
    metrics_port: int = field(default=9104, metadata={"help": "/metrics and /health (0 off)"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})

    def __post_init__(self) -> None:
        self.group_size = algorithm_group_size(self.algorithm)
        if self.high_water < 1:
            raise ValueError(f"feeder high_water={self.high_water} must be >= 1")
        staleness.check_bound("max_head_offpolicyness", self.max_head_offpolicyness)
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


async def admitted_groups(r: Any, keys: transport.Keys, settings: FeederSettings) -> int | None:
    """Groups the learner has room for now (None: admission control off; 0 before a learner
    announced its batch size)."""
    if settings.max_head_offpolicyness is None:
        return None
    st = await accounting.admission_state(r, keys, settings.group_size)
    if st is None:
        return 0
    room = staleness.admission_room(
        served_step=st["served_step"],
        batch_size=st["batch_size"],
        trained=st["trained"],
        outstanding=st["outstanding"],
        max_head_offpolicyness=settings.max_head_offpolicyness,
    )
    assert room is not None
    return room // settings.group_size


async def top_up(r: Any, keys: transport.Keys, settings: FeederSettings, limit: int) -> int:
    """Add requests until the backlog reaches ``high_water`` (at most ``limit``, and at most
    what admission control has room for)."""
    n = min(settings.high_water - await transport.backlog(r, keys.requests), limit)
    if n <= 0:
        FULL.inc()
        return 0
    admitted = await admitted_groups(r, keys, settings)
    if admitted is not None and admitted < n:
        n = admitted
        if n <= 0:
            NO_ROOM.inc()
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
