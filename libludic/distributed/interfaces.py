"""How the learner hands new weights to whoever serves the policy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class PolicyPublisher(Protocol):
    """``publish(state_dict, version)``: make ``state_dict`` (full tensors, HF parameter
    names) the served policy, labelled ``version``. Returns once the new weights serve new
    requests; raises if they could not be applied. Called on every rank under FSDP2 (the
    implementation decides which rank talks to the servers)."""

    def publish(self, state_dict: Mapping[str, Tensor], version: int | None) -> None: ...
