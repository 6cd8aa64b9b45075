"""EvalSet: one named evaluation (env, protocol, problems, sampling) and its requests.

Problem ``i`` of a set is env seed ``i`` (``i < n``; the held-out split is the env's
kwargs, e.g. ``{"split": "eval"}``). The greedy pass runs each problem once at temperature
0 (sampling seed ``i``); with ``k > 0`` each problem also runs ``k`` sampled episodes at
``temperature``, sampling seeds ``i*k .. i*k + k-1`` (distinct across the set), for
pass@k and mean@k (libludic/eval/metrics.py). An episode lasts at most ``max_steps`` turns
(a multi-turn env needs more than 1). Requests carry ``meta["problem"] = i``.

Written in config as ``{name, env: {kind, kwargs}, protocol: {kind, kwargs[, agent]}, n,
max_tokens, max_steps, k, temperature, pass_threshold}`` (:meth:`EvalSet.from_dict`).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from libludic.inference.request import InferenceSpec
from libludic.inference.sampling import SamplingConfig
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a Prometheus label value, a TensorBoard tag part


@dataclass(frozen=True)
class EvalSet:
    name: str
    env: Mapping[str, Any]
    protocol: Mapping[str, Any] | None = None  # None: single_agent, identity parser
    n: int = 200
    max_tokens: int = 8
    max_steps: int = 1
    k: int = 0  # sampled episodes per problem (0: greedy only)
    temperature: float = 1.0  # of the k samples
    pass_threshold: float = 1.0
    # the config keys' common prefix, for errors: "up.eval_sets[1] (selfplay)." or "up.eval_"
    where: str = field(default="EvalSet.", compare=False, repr=False)

    KEYS = (
        "name",
        "env",
        "protocol",
        "n",
        "max_tokens",
        "max_steps",
        "k",
        "temperature",
        "pass_threshold",
    )

    def __post_init__(self) -> None:
        w = self.where
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ValueError(
                f"{w}name={self.name!r}: use letters, digits, '_', '.' or '-' (it names the "
                "set in metric labels and TensorBoard tags)"
            )
        if not isinstance(self.env, Mapping) or "kind" not in self.env:
            raise ValueError(f"{w}env={self.env!r} must be a mapping with 'kind' (and 'kwargs')")
        for key, low in (("n", 1), ("max_tokens", 1), ("max_steps", 1), ("k", 0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{w}{key}={v!r} must be an integer >= {low}")
        for key in ("temperature", "pass_threshold"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{w}{key}={v!r} must be a finite number")
        if self.k > 0 and self.temperature <= 0:
            raise ValueError(
                f"{w}temperature={self.temperature} must be > 0 for the k={self.k} samples "
                "(greedy is always run; k: 0 for greedy only)"
            )

    @classmethod
    def from_dict(cls, d: Any, where: str) -> EvalSet:
        """A set from config; unknown keys are an error listing the known ones."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}={d!r} must be a mapping with keys {list(cls.KEYS)}")
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            near = {u: difflib.get_close_matches(u, cls.KEYS, n=1) for u in unknown}
            hint = "".join(f"; {u!r}: did you mean {m[0]!r}?" for u, m in near.items() if m)
            raise ValueError(f"{where} has unknown keys {unknown}; known: {list(cls.KEYS)}{hint}")
        for key in ("name", "env"):
            if key not in d:
                raise ValueError(f"{where} needs {key!r} (keys: {list(cls.KEYS)})")
        return cls(where=f"{where} ({d['name']}).", **{k: d[k] for k in cls.KEYS if k in d})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.KEYS}

    @property
    def roles(self) -> list[str] | None:
        """The protocol's roles (``kwargs.roles`` of ``multi_agent``), None for one agent."""
        roles = ((self.protocol or {}).get("kwargs") or {}).get("roles")
        return [str(r) for r in roles] if isinstance(roles, list) else None

    def _requests(self, temperature: float, k: int) -> list[RolloutRequest]:
        spec = InferenceSpec(
            sampling=SamplingConfig(temperature=temperature, max_tokens=self.max_tokens)
        )
        proto = ProtocolSpec() if self.protocol is None else ProtocolSpec.from_dict(self.protocol)
        return [
            RolloutRequest(
                env=EnvSpec.from_dict(self.env),
                protocol=proto,
                env_seed=i,
                sampling_seed=i * max(k, 1),
                inference=spec,
                num_episodes=max(k, 1),
                same_env_seed=True,
                meta={"eval": True, "problem": i},
            )
            for i in range(self.n)
        ]

    def greedy_requests(self) -> list[RolloutRequest]:
        """One temperature-0 episode per problem (env seed i, sampling seed i)."""
        return self._requests(0.0, 0)

    def sample_requests(self) -> list[RolloutRequest]:
        """``k`` episodes per problem at ``temperature`` (none when k is 0)."""
        return self._requests(self.temperature, self.k) if self.k > 0 else []
