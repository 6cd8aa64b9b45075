"""A multi-turn verifiers 0.4.0 environment for tests/adapters/test_verifiers_env.py.

Shaped like verifiers' own TextArena and OpenEnv environments: an ``Env`` subclass whose
``run()`` opens the ``player`` seat's ``interaction(task)`` and plays the user, one
``turn()`` per move: the player guesses a secret number in 1..8 and hears "higher" or
"lower" until it is right or has used ``max_guesses``. ``run()`` records
``solved`` = 1 - 0.25 * (guesses - 1) (0 when never found) on the trace; the task adds
``@vf.reward`` ``polite`` (weight 0.1: 1 when no reply is empty) through scoring.
"""

from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessTaskset"]


class GuessData(vf.TaskData):
    secret: int
    max_guesses: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.1)
    async def polite(self, trace: vf.Trace) -> float:
        return 1.0 if all(m.content for m in trace.assistant_messages) else 0.0


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        guesses = 0
        solved = False
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                guesses += 1
                reply = segment.last_reply
                guess = int(reply) if reply.lstrip("-").isdigit() else None
                if guess == task.data.secret:
                    solved = True
                    break
                if guesses >= task.data.max_guesses:
                    break
                hint = "higher" if guess is None or guess < task.data.secret else "lower"
                segment = await interaction.turn(hint)
        score = 1.0 - 0.25 * (guesses - 1) if solved else 0.0
        interaction.trace.record_reward("solved", score)
        interaction.trace.info["guesses"] = guesses


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self) -> Iterator[GuessTask]:
        for secret in (5, 2, 7):
            yield GuessTask(
                GuessData(
                    prompt="Guess my number in 1..8. Reply with the number only.",
                    secret=secret,
                    max_guesses=4,
                ),
                self.config.task,
            )
