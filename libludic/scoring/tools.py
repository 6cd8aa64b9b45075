"""Rewards on an episode's tool calls: ``tool_result``, an intermediate reward for calling a
tool right, whatever the model answered after it.

A ToolAgent's tool calls are steps of their own (``info["kind"] == "tool_call"``) whose
next observation holds one ``"<tool name>: <output>"`` line per call (``"error: ..."`` for a
call that failed). ``tool_result`` scores 1.0 when one of those outputs is exactly the
env's reference answer (``info[answer_key]``, from the last step that states it), else 0.0.
With the calculator on products, the call's operands were copied right: the part of the
episode the model learns last (examples/tool_use). Give it a weight below the env's
reward, so that answering right stays worth the most::

    reward: {functions: [{kind: tool_result, weight: 0.5}]}
"""

from __future__ import annotations

from libludic.scoring.base import RewardError, RewardInput


def tool_result(sample: RewardInput, answer_key: str = "answer") -> float:
    steps = sample.rollout.steps
    reference = next((s.info[answer_key] for s in reversed(steps) if answer_key in s.info), None)
    if reference is None:
        raise RewardError(
            f"tool_result: no step of the episode has info[{answer_key!r}] (the env's "
            "reference answer); set answer_key to the key the env states it under"
        )
    want = str(reference).strip()
    for step in steps:
        if step.info.get("kind") != "tool_call":
            continue
        for line in str(step.next_obs or "").splitlines():
            name, sep, output = line.partition(": ")
            if sep and name != "error" and output.strip() == want:
                return 1.0
    return 0.0
