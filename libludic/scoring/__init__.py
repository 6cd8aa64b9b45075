"""Reward functions composed with an env's reward: the contract (base.py), an LLM judge on
any OpenAI-compatible endpoint (judge.py) and a remote verifier over HTTP (remote.py)."""
