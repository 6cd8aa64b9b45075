"""What the training code asks of a model beyond ``nn.Module``, as Protocols checked at run
time: a transformers ``PreTrainedModel`` has all of them, a peft LoRA model forwards them
to its base, and a model without one of them is told apart by ``isinstance`` (never by
``getattr`` with a default)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from torch import nn
from typing_extensions import TypeIs


@runtime_checkable
class HasInputEmbeddings(Protocol):
    """transformers' ``get_input_embeddings``: the token embedding (its rows are the vocab)."""

    def get_input_embeddings(self) -> nn.Module: ...


@runtime_checkable
class Checkpointable(Protocol):
    """transformers' activation checkpointing switch (``supports_gradient_checkpointing``
    says whether the architecture implements it)."""

    supports_gradient_checkpointing: bool

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any] | None = None
    ) -> None: ...


@runtime_checkable
class HasConfig(Protocol):
    """A transformers model's ``config`` (``pad_token_id``, ``eos_token_id``, ``use_cache``)."""

    config: Any


@runtime_checkable
class HasBaseModel(Protocol):
    """transformers' ``base_model`` (the decoder under a causal LM's head) and ``config``
    (``hidden_size``): what a critic is built from (libludic/training/critic.py)."""

    base_model: nn.Module
    config: Any


@runtime_checkable
class PeftWrapped(Protocol):
    """A peft model: the base under the adapters, and a context with the adapters off."""

    peft_config: Any

    def get_base_model(self) -> nn.Module: ...

    def disable_adapter(self) -> AbstractContextManager[Any]: ...


def is_peft(model: object) -> TypeIs[PeftWrapped]:
    """``model`` is a peft (LoRA) model."""
    return isinstance(model, PeftWrapped)
