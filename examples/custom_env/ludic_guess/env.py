"""GuessEnv: find a secret number in ``[low, high]``, told "higher" or "lower" after each guess.

A multi-turn, single-agent env (``SingleAgentEnv``): the seed picks the secret and the
interval the game starts from. Each turn the agent answers with a number; the env replies
``"Higher. Between a and b."``, ``"Lower. Between a and b."`` (the interval left) or ends
the game. Reward: 1.0 when the secret is guessed, 0 otherwise; a reply that is not a number
in the interval costs ``bad_guess_reward`` and the turn (the game goes on). The game ends
after ``max_guesses`` guesses. Its reference completion (the optimal guess, the middle of
the interval) makes it a supervised task too (``up.sft_task: {kind: env, kwargs: {env:
{kind: guess}}}``).
"""

from __future__ import annotations

import random
import re

from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.types import Info, StepOutcome

SYSTEM_PROMPT = "Guess the secret number. Reply with one number."


class GuessEnv(SingleAgentEnv):
    def __init__(
        self,
        low: int = 1,
        high: int = 32,
        max_guesses: int = 6,
        bad_guess_reward: float = -0.2,
    ) -> None:
        if not low < high:
            raise ValueError(f"GuessEnv needs low < high; got low={low}, high={high}")
        if max_guesses < 1:
            raise ValueError(f"max_guesses={max_guesses} must be >= 1")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.bad_guess_reward = bad_guess_reward
        self.lo, self.hi, self.secret, self.guesses = low, high, low, 0

    @property
    def suggested_system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def env_reset(self, *, seed: int | None = None) -> tuple[str, Info]:
        rng = random.Random(seed)
        a, b = sorted(rng.sample(range(self.low, self.high + 1), 2))
        self.lo, self.hi = a, b
        self.secret = rng.randint(a, b)
        self.guesses = 0
        return self.env_current_obs(), {"low": a, "high": b}

    def env_current_obs(self) -> str:
        return f"Between {self.lo} and {self.hi}."

    def reference_completion(self) -> str:
        """The optimal guess: the middle of the interval left."""
        return str((self.lo + self.hi) // 2)

    def score_completion(self, completion: str, reference: str) -> float:
        return 1.0 if completion.strip() == reference else 0.0

    def env_step(self, action: str) -> StepOutcome:
        self.guesses += 1
        last = self.guesses >= self.max_guesses
        m = re.fullmatch(r"\s*(-?\d+)\s*\.?\s*", action)
        guess = int(m.group(1)) if m else None
        info: Info = {"guesses": self.guesses, "reference": str(self.secret)}
        if guess is None or not self.lo <= guess <= self.hi:
            info["bad_guess"] = True
            obs = f"Not a number between {self.lo} and {self.hi}."
            return StepOutcome(obs, self.bad_guess_reward, truncated=last, info=info)
        if guess == self.secret:
            return StepOutcome("Correct.", 1.0, terminated=True, info={**info, "result": "found"})
        if guess < self.secret:
            self.lo = guess + 1
            word = "Higher"
        else:
            self.hi = guess - 1
            word = "Lower"
        if last:
            return StepOutcome(f"{word}. Out of guesses.", 0.0, truncated=True, info=info)
        return StepOutcome(f"{word}. {self.env_current_obs()}", 0.0, info=info)
