"""A verifiers 0.4.0 taskset for tests/adapters/test_verifiers_env.py: single-turn sums.

Written against the library's own API, the way a verifiers environment package is: a
``Taskset`` subclass exported through ``__all__`` whose tasks score the trace with
``@vf.reward`` (weighted) and ``@vf.metric`` (recorded, not summed). It plays under
verifiers' default ``SingleAgentEnv`` (one ``agent`` seat, one reply). Task ``i`` asks
``i + 2 * i``; ``correct`` is 1 when the last reply is that number, ``short`` 0.5 (weight
0.5) when the reply has at most 3 characters.
"""

from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["SumsTaskset"]


class SumsData(vf.TaskData):
    answer: int


class SumsTask(vf.Task[SumsData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == str(task.answer) else 0.0

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return 0.5 if len(trace.last_reply.strip()) <= 3 else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumsConfig(vf.TasksetConfig):
    n: int = 4


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self) -> Iterator[SumsTask]:
        for i in range(self.config.n):
            yield SumsTask(
                SumsData(
                    name=f"sum-{i}",
                    prompt=f"What is {i} + {2 * i}?",
                    system_prompt="Answer with the number only.",
                    answer=3 * i,
                ),
                self.config.task,
            )
