"""Supervised warm starts: ``run_sft`` (run.py) trains a model on demonstrations with the
library's Trainer and checks it with greedy episodes of an env; tasks.py builds the
demonstrations and checks from any env that states its reference; cli.py is ``ludic sft``.
It sits above both sides it joins: libludic.training (the step) and the rollout side (envs,
agents, the greedy evaluator)."""
