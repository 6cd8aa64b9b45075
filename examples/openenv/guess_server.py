"""An OpenEnv (openenv-core 0.3.0) environment server: examples/openenv/grpo.yaml plays it,
tests/adapters/test_openenv_env.py tests the adapter against it.

Built the way an OpenEnv environment is: an ``Environment`` with pydantic ``Action`` and
``Observation`` models served by ``create_app`` (HTTP routes and the ``/ws`` sessions, one
environment instance per session, 8 at once). The game: guess the secret number
``seed % 8 + 1``; a wrong guess is answered "higher" or "lower" with reward -0.1, the right
one ends the episode with reward 1.0, the fourth wrong guess ends it. Serve it from the
openenv side venv (scripts/adapter-venvs.sh):

    runs/venvs/openenv/bin/python examples/openenv/guess_server.py --port 8011
"""

from __future__ import annotations

import argparse
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_GUESSES = 4


class GuessAction(Action):
    guess: int = Field(..., description="The number guessed, 1..8")


class GuessObservation(Observation):
    message: str = Field(default="", description="What the host says")
    guesses: int = Field(default=0, description="Guesses so far")


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 1

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = (seed or 0) % 8 + 1
        return GuessObservation(message="Guess my number in 1..8.", reward=0.0)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state.step_count += 1
        n = self._state.step_count
        if action.guess == self._secret:
            return GuessObservation(message="right", guesses=n, done=True, reward=1.0)
        hint = "higher" if action.guess < self._secret else "lower"
        return GuessObservation(message=hint, guesses=n, done=n >= MAX_GUESSES, reward=-0.1)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=8
)

if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
