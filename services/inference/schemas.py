"""Request/response models of the Ludic-specific endpoints.

The OpenAI endpoints reuse vLLM's own protocol models (``CompletionRequest``,
``ChatCompletionRequest``); the server adds ``policy_version`` to their responses.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from libludic.distributed.weight_sync import WIRE_DTYPES


class PolicyVersionResponse(BaseModel):
    policy_version: int
    # the dtype the weights are served in (torch spelling, e.g. "bfloat16"): publishers may
    # cast floating tensors to it before sending (any of float32/bfloat16/float16 is accepted)
    dtype: str | None = None


class HealthResponse(BaseModel):
    status: Literal["ok", "unhealthy"]
    policy_version: int
    reason: str = ""


#: the learner's rank 0 and one rank per replica; far past any deployment
MAX_COLLECTIVE_WORLD = 1 << 16


class CollectiveInitRequest(BaseModel):
    # strict: a bool or a float is no rank or port. Bounded: a body that passes opens a
    # rendezvous, which waits up to collective_timeout_s for peers that never come
    model_config = ConfigDict(extra="forbid", strict=True)

    master_address: str = Field(min_length=1, max_length=253)  # a DNS name's limit
    master_port: int = Field(gt=0, lt=65536)
    world_size: int = Field(ge=2, le=MAX_COLLECTIVE_WORLD)
    backend: Literal["gloo", "nccl"] = "gloo"
    # Ludic extension of the contract: this replica's first rank (the learner is 0); its
    # vLLM workers take rank .. rank + workers - 1. Default 1 for the one-replica case;
    # CollectiveWeightSender gives replica i the ranks after those of replicas 0..i-1.
    rank: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _rank_in_world(self) -> CollectiveInitRequest:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        return self


class CollectiveInfoResponse(BaseModel):
    # vLLM workers of this replica (tensor x pipeline parallel): each is a rank of the group
    workers: int
    backends: list[str]  # group backends its workers can join (nccl: CUDA workers)


class CollectiveInitResponse(BaseModel):
    rank: int  # the replica's first rank
    world_size: int
    backend: str
    workers: int = 1


class CollectiveUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    # Round number chosen by the sender; keys the ack/go handshake in the group's store.
    round: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _same_lengths(self) -> CollectiveUpdateRequest:
        n = len(self.names)
        if len(self.dtypes) != n or len(self.shapes) != n:
            raise ValueError(
                f"names/dtypes/shapes must have equal lengths, got {n}/{len(self.dtypes)}/"
                f"{len(self.shapes)}"
            )
        if len(set(self.names)) != n:
            raise ValueError("names contains duplicates")
        bad = sorted({d for d in self.dtypes if d not in WIRE_DTYPES})
        if bad:
            raise ValueError(f"unknown dtype(s) {bad}; use one of {sorted(WIRE_DTYPES)}")
        if any(d < 0 for s in self.shapes for d in s):
            raise ValueError("shapes must be non-negative")
        return self
