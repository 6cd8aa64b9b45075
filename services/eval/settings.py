"""The eval service's settings (the ``eval:`` section of the run config, falling back to the
launcher's ``up.eval_*``): the eval sets (``sets``, else one set of ``env``, ``protocol``,
``n``, ``max_tokens``; services/common/heldout.py), when to evaluate and where results go."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.common import heldout
from services.common.settings import RedisService, secret, secret_from_file

_UP_FALLBACK = {
    "env": "eval_env",
    "n": "eval_n",
    "every_steps": "eval_every_steps",
    "max_tokens": "eval_max_tokens",
    "protocol": "eval_protocol",
    "sets": "eval_sets",
}


@dataclass
class EvalSettings(RedisService):
    # a field left unset takes the launcher's value in the run config's up: section, then
    # the launcher's default
    FROM_SECTIONS: ClassVar[dict[str, tuple[str, str]]] = {
        mine: ("up", theirs) for mine, theirs in _UP_FALLBACK.items()
    }

    inference_urls: list[str] = field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        metadata={"help": "inference base URLs; the first one is evaluated"},
    )
    api_key: str | None = secret(
        "bearer token for inference",
        "set LUDIC_API_KEY, or name a file holding it with api_key_file (--api-key-file)",
    )
    api_key_file: str | None = field(
        default=None, metadata={"help": "file holding the inference token (else LUDIC_API_KEY)"}
    )
    env: dict[str, Any] | None = field(
        default=None, metadata={"help": "held-out env {kind, kwargs} (default: up.eval_env)"}
    )
    protocol: dict[str, Any] | None = field(
        default=None,
        metadata={"help": "protocol {kind, kwargs} of the evaluation (default: up.eval_protocol)"},
    )
    n: int | None = field(default=None, metadata={"help": "held-out problems (default: up.eval_n)"})
    every_steps: int | None = field(
        default=None,
        metadata={"help": "learner steps between evaluations (default: up.eval_every_steps)"},
    )
    max_tokens: int | None = field(
        default=None, metadata={"help": "max tokens of an answer (default: up.eval_max_tokens)"}
    )
    sets: list[dict[str, Any]] | None = field(
        default=None,
        metadata={
            "help": "eval sets [{name, env, protocol, n, max_tokens, max_steps, k, temperature, "
            "pass_threshold}] (default: up.eval_sets; empty: one set 'heldout' of env, "
            "protocol, n and max_tokens)"
        },
    )
    at_start: bool = field(default=True, metadata={"help": "evaluate step 0 (the starting policy)"})
    settle_s: float = field(
        default=60.0, metadata={"help": "evaluate a step the learner stayed at this long (0 off)"}
    )
    version_wait_s: float = field(
        default=60.0,
        metadata={"help": "wait this long for inference to serve the learner's version"},
    )
    poll_s: float = field(
        default=2.0, metadata={"help": "seconds between looks at the learner step"}
    )
    output_file: str = field(default="", metadata={"help": "append each result as JSON here"})
    tensorboard_dir: str = field(
        default="",
        metadata={
            "help": "write eval/<set>/<figure> scalars at the learner step here (needs "
            "tensorboard; '' off)"
        },
    )
    metrics_port: int = field(default=9105, metadata={"help": "/metrics and /health (0 off)"})

    def __post_init__(self) -> None:
        self.api_key = secret_from_file(self.api_key, self.api_key_file, "LUDIC_API_KEY", "api key")
        for mine, theirs in _UP_FALLBACK.items():
            if getattr(self, mine) is None:
                setattr(self, mine, copy.deepcopy(heldout.DEFAULTS[theirs]))
        n, every, most = self.n, self.every_steps, self.max_tokens
        assert n is not None and every is not None and most is not None  # filled above
        self.n, self.every_steps, self.max_tokens = int(n), int(every), int(most)
        if not self.sets and self.n < 1:
            raise ValueError(f"eval n={self.n} must be >= 1 (set eval.n or up.eval_n)")
        if self.every_steps < 0:
            raise ValueError(
                f"eval every_steps={self.every_steps} must be >= 0 (0: start/settle only)"
            )
        if not self.inference_urls:
            raise ValueError("eval needs an inference URL: set LUDIC_INFERENCE_URLS")
        # the sets every evaluation runs, each built once here
        self.parsed_sets = heldout.eval_sets(
            self.sets or [],
            self.env,
            self.protocol,
            self.n,
            self.max_tokens,
            sets_key="eval.sets",
            prefix="eval.",
        )
