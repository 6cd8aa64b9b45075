"""A verifiers 0.4.0 environment package for examples/verifiers/grpo.yaml: boxed sums.

What an environment from the Environments Hub looks like, small enough to read: a
``Taskset`` exported through ``__all__`` (its id is this module's name, ``vf_boxed_sums``)
whose tasks carry a prompt, a system prompt and the answer, and whose ``@vf.reward`` is
verifiers' own math-verify check of the ``\\boxed{}`` answer. Task ``i`` of 100 asks
``i // 10 + i % 10``; ``split: eval`` holds out every 8th task (13), ``train`` the rest.
"""

from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf

__all__ = ["BoxedSumsTaskset"]

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."


class BoxedSumsData(vf.TaskData):
    answer: str


class BoxedSumsTask(vf.Task[BoxedSumsData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: BoxedSumsData, trace: vf.Trace) -> float:
        return vf.verify_boxed_math_answer(trace.last_reply, task.answer)


class BoxedSumsConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"


class BoxedSumsTaskset(vf.Taskset[BoxedSumsTask, BoxedSumsConfig]):
    def load(self) -> Iterator[BoxedSumsTask]:
        for i in range(100):
            if (i % 8 == 0) != (self.config.split == "eval"):
                continue
            a, b = divmod(i, 10)
            yield BoxedSumsTask(
                BoxedSumsData(
                    name=f"sum-{a}-{b}",
                    prompt=f"What is {a} + {b}?",
                    system_prompt=SYSTEM_PROMPT,
                    answer=str(a + b),
                ),
                self.config.task,
            )
