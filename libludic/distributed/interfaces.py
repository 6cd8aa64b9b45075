"""How the learner hands new weights to whoever serves the policy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from libludic.distributed.publisher import ReplicaSet


@runtime_checkable
class PolicyPublisher(Protocol):
    """``publish(state_dict, version)``: make ``state_dict`` (full tensors, HF parameter
    names) the served policy, labelled ``version``. Returns once the new weights serve new
    requests; raises if they could not be applied. The Trainer calls it on rank 0 only, in
    a background thread (it may block on the network), and shares the outcome with the
    other ranks; the state dict is a snapshot the caller no longer changes."""

    def publish(self, state_dict: Mapping[str, Tensor], version: int | None) -> None: ...


class WeightPlane(PolicyPublisher, Protocol):
    """A PolicyPublisher to a set of inference replicas, whatever carries the tensors
    (libludic/distributed/publisher.py: ``HttpPolicyPublisher``, safetensors over HTTP, full
    weights or a LoRA adapter; ``BroadcastPolicyPublisher``, a gloo/NCCL collective). What
    the learner service reads of it besides ``publish``: the ``replicas`` it resolves,
    ``acked`` (replica -> last acknowledged version), ``last_bytes`` (the last publish's
    tensor bytes on the wire) and ``close()``."""

    replicas: ReplicaSet
    acked: dict[str, int]
    last_bytes: int

    def close(self) -> None: ...
