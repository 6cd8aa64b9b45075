"""The ``fewer_guesses`` reward function: a bonus for finding the secret in fewer guesses.

A reward function scores one rollout (``sample``: libludic/scoring/base.py ``RewardInput``)
and its score, times its weight, is added to the env's reward at the episode's last step.
"""

from libludic.scoring.base import RewardInput


def fewer_guesses(sample: RewardInput, max_guesses: int = 6) -> float:
    """``(max_guesses - guesses) / max_guesses`` when the secret was found, else 0."""
    if sample.info.get("result") != "found":
        return 0.0
    used = int(sample.info.get("guesses", max_guesses))
    return max(0, max_guesses - used) / max_guesses
