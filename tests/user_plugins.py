"""What a user's own package would hold, named by import path in the tests' configs
(``tests.user_plugins:Name``): an env, an agent, a tool, a parser factory, a protocol and
reward functions, none of them registered anywhere."""

from __future__ import annotations

from typing import Any

from libludic.agents.base_agent import Agent
from libludic.agents.config import MakeAgent
from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.interaction.single_agent import SingleAgentSyncProtocol
from libludic.parsers import Parser, ParseResult
from libludic.scoring.base import RewardInput
from libludic.types import Info, StepOutcome


class EchoAgent(Agent):
    """A plain Agent with a keyword of its own."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = prefix


class CountDownEnv(SingleAgentEnv):
    """Say the numbers from ``start`` down to 1, one per turn: +1 for each right one, the
    episode ends at 1 or at the first wrong number (reward 0 for it)."""

    def __init__(self, start: int = 3) -> None:
        if start < 1:
            raise ValueError(f"start={start} must be >= 1")
        self.start = start
        self.next = start

    def env_reset(self, *, seed: int | None = None) -> tuple[str, Info]:
        self.next = self.start
        return self.env_current_obs(), {}

    def env_current_obs(self) -> str:
        return f"Say {self.next}."

    def env_step(self, action: str) -> StepOutcome:
        if action.strip() != str(self.next):
            return StepOutcome("wrong", 0.0, terminated=True, info={"expected": str(self.next)})
        self.next -= 1
        if self.next == 0:
            return StepOutcome("done", 1.0, terminated=True, info={"reference": "1"})
        return StepOutcome(self.env_current_obs(), 1.0)


class BrokenEnv(CountDownEnv):
    def env_reset(self, *, seed: int | None = None) -> tuple[str, Info]:
        raise RuntimeError("the dataset file is missing")


def double(x: int) -> int:
    """Twice x."""
    return 2 * x


def last_word(penalty: float = -1.0) -> Parser:
    """The reply's last word as the action."""

    def parse(text: str) -> ParseResult:
        words = text.split()
        return (
            ParseResult(words[-1], 0.0, None)
            if words
            else ParseResult(None, penalty, "say something")
        )

    return parse


def patient(make_agent: MakeAgent, parser: Any = None, retries: int = 1) -> SingleAgentSyncProtocol:
    """A protocol of the user's: the single-agent loop that stops on a parse error unless
    ``retries`` > 0."""
    return SingleAgentSyncProtocol(make_agent(parser), stop_on_parse_error=retries == 0)


def brevity(sample: RewardInput, max_chars: int = 10) -> float:
    """1 for a reply of at most ``max_chars`` characters, else 0."""
    return 1.0 if len(sample.completion) <= max_chars else 0.0


async def async_bonus(sample: RewardInput, bonus: float = 0.5) -> float:
    return bonus if sample.answer is not None else 0.0


class Matches:
    """A reward class: 1 when the parsed answer equals ``info[key]``."""

    def __init__(self, key: str = "reference") -> None:
        self.key = key

    def __call__(self, sample: RewardInput) -> float:
        return float(sample.answer is not None and sample.answer == sample.info.get(self.key))


def broken_reward(sample: RewardInput) -> float:
    raise ConnectionError("verifier unreachable")


class OddSeedsFail(CountDownEnv):
    """Fails at reset on an odd seed: an env whose bug shows on some problems only (the
    start-up check resets seed 0 and passes)."""

    def env_reset(self, *, seed: int | None = None) -> tuple[str, Info]:
        if seed is not None and seed % 2:
            raise ValueError(f"problem {seed} is malformed")
        return super().env_reset(seed=seed)


class FailsAfterTheCheck(CountDownEnv):
    """Resets at seed 0 (the start-up check's) and fails on every other seed: a task that
    passes ``check_task`` and then has every request dead-lettered."""

    def env_reset(self, *, seed: int | None = None) -> tuple[str, Info]:
        if seed:
            raise ValueError(f"cannot load problem {seed}")
        return super().env_reset(seed=seed)


class PaddedEnv(CountDownEnv):
    """CountDownEnv whose first prompt carries ``pad + seed % 4`` dashes before "Say N.": a
    prompt of known length that differs between seeds (the item-length estimate takes the
    longest)."""

    def __init__(self, start: int = 3, pad: int = 0) -> None:
        super().__init__(start)
        self.pad = pad
        self.seed = 0

    def env_reset(self, *, seed: int | None = None) -> tuple[str, Info]:
        self.seed = seed or 0
        return super().env_reset(seed=seed)

    def env_current_obs(self) -> str:
        return "-" * (self.pad + self.seed % 4) + super().env_current_obs()
