"""Logprobs of the policies a step reads besides the one it trains (the frozen reference of
a KL term, the proximal policy of the decoupled loss): a no-grad forward of every token."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from libludic.training import loss as L
from libludic.training.model_api import Checkpointable, HasConfig


@torch.no_grad()
def every_token_logprobs(
    model: nn.Module, batch: Mapping[str, Any], autocast: contextlib.AbstractContextManager[Any]
) -> torch.Tensor:
    """``model``'s logprob of every token of ``batch`` at the item's temperature, aligned to
    input_ids ([B, T] fp32, 0.0 at position 0 which nothing predicts); the forward runs
    under ``autocast``."""
    ids = batch["input_ids"]
    with autocast:
        out = model(input_ids=ids, attention_mask=batch["attention_mask"])
    logits = L.apply_temperature((out.logits if hasattr(out, "logits") else out).float(), batch)
    lp = torch.zeros(ids.shape, dtype=torch.float32, device=logits.device)
    lp[:, 1:] = L.token_logprobs(logits, ids)
    return lp


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (no dropout) for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """transformers' activation checkpointing, non-reentrant (it composes with FSDP2 and with
    inputs that need no grad); the KV cache is off while training. A model without it is
    refused: the setting must not silently do nothing."""
    if not isinstance(model, Checkpointable) or not model.supports_gradient_checkpointing:
        raise ValueError(
            f"TrainerConfig.gradient_checkpointing=True but {type(model).__name__} does not support "
            "it (a transformers PreTrainedModel with supports_gradient_checkpointing does)"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if isinstance(model, HasConfig) and hasattr(model.config, "use_cache"):
        model.config.use_cache = False


DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def disable_dropout(model: nn.Module) -> int:
    """Every dropout of ``model`` off (AReaL's ``disable_dropout``): the dropout layers' ``p``
    and transformers' attention dropout (a float ``attention_dropout`` on the attention
    modules, read at each forward) set to 0, so a training forward computes what the served
    policy computes. Returns how many were on."""
    n = 0
    for m in model.modules():
        if isinstance(m, DROPOUTS):
            n += m.p > 0
            m.p = 0.0
        p = m.__dict__.get("attention_dropout")  # a plain attribute, never a submodule
        if isinstance(p, float):
            n += p > 0
            setattr(m, "attention_dropout", 0.0)  # noqa: B010 (nn.Module types attributes as modules)
    return n
