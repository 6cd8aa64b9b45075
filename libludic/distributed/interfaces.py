"""How the learner hands new weights to whoever serves the policy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class PolicyPublisher(Protocol):
    """``publish(state_dict, version)``: make ``state_dict`` (full tensors, HF parameter
    names) the served policy, labelled ``version``. Returns once the new weights serve new
    requests; raises if they could not be applied. The Trainer calls it on rank 0 only, in
    a background thread (it may block on the network), and shares the outcome with the
    other ranks; the state dict is a snapshot the caller no longer changes."""

    def publish(self, state_dict: Mapping[str, Tensor], version: int | None) -> None: ...
