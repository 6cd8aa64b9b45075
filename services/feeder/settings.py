"""The feeder's settings (the ``feeder:`` section of the run config) and its curriculum (``Task``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libludic import staleness
from libludic.agents.config import validate_agent_config
from libludic.inference.request import InferenceSpec, ReturnSpec
from libludic.requests import EnvSpec, ProtocolSpec
from services.common.settings import algorithm_group_size


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
