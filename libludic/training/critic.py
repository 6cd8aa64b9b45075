"""PPO's critic: V(s_t) for every token position, a value model of its own beside the policy.

A separate model, not a value head on the policy's backbone (AReaL's choice too, its
``critic`` engine): the value loss's gradient never reaches the weights the inference
servers sample from, so the published policy does not depend on how well the critic fits
or on a loss coefficient between the two; what is published, checkpointed as the policy
and resumed stays the policy alone; and the critic has its own optimizer (its learning rate
``TrainerConfig.critic_lr``, its own gradient clipping). The cost: a second copy of the
weights (a second shard per rank under FSDP2) and its forward and backward per micro-batch.

:class:`ValueModel` is the policy's architecture without its LM head (transformers'
``base_model``, the decoder) and a linear head on the last hidden state, zero-initialised so
V = 0 everywhere at the start (GAE's first advantages are then the discounted returns).
:class:`Critic` is what a Trainer holds of it: the module (sharded like the policy by
``parallel.shard_from_rank0`` under FSDP2), its optimizer, the no-grad values and GAE's
advantages of a step's items before its first update (``add_advantages``), and the values
with grad in each micro-batch's loss.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from libludic.saw import SAWItem
from libludic.training import loss as L
from libludic.training import policies, ranks
from libludic.training.gae import GAE
from libludic.training.model_api import HasBaseModel
from libludic.training.parallel import full_tensor
from libludic.training.value_loss import OLD_VALUES_KEY, RETURNS_KEY


class ValueModel(nn.Module):
    """V(s_t) = w . h_t + b, h_t the backbone's last hidden state at position t (the state
    after tokens 0..t).   input_ids, attention_mask ``# [B, T]`` -> values ``# [B, T]``."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        # FSDP2 shards these blocks one by one (parallel.decoder_layers)
        self._no_split_modules = list(getattr(backbone, "_no_split_modules", None) or [])

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        values: Tensor = self.value_head(h).squeeze(-1)
        return values

    @classmethod
    def from_policy(cls, policy: nn.Module) -> ValueModel:
        """A copy of ``policy``'s backbone (a transformers causal LM's ``base_model``: the
        decoder without the LM head, its weights as they are now) under a zero head."""
        if not isinstance(policy, HasBaseModel) or policy.base_model is policy:
            raise ValueError(
                f"cannot build a critic from {type(policy).__name__}: it has no transformers "
                "base_model (the decoder under the LM head) and config.hidden_size; pass "
                "critic_model= to the Trainer (a module mapping input_ids, attention_mask to "
                "values [B, T])"
            )
        return cls(copy.deepcopy(policy.base_model), int(policy.config.hidden_size))


class Critic:
    """The value model a Trainer trains beside its policy (module docstring): ``model`` (on
    its device, sharded under FSDP2 by the caller), ``optimizer`` (stepped with the policy's,
    at ``lr`` x the schedule's factor), ``gae`` (the algorithm's)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr: float,
        gae: GAE,
        device: torch.device,
        distributed: bool,
    ) -> None:
        self.model, self.optimizer, self.lr, self.gae = model, optimizer, lr, gae
        self.device, self.distributed = device, distributed
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the critic has no trainable parameters")
        self.grad_norm = 0.0  # the last optimizer step's, before clipping

    def values(self, batch: dict[str, Any]) -> Tensor:
        """V on the shifted grid ``# [B, T-1]`` (position t: the state that samples token
        t+1, as the losses' logp), fp32, with grad."""
        v: Tensor = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return v[:, :-1].float()

    def add_advantages(
        self,
        batches: Sequence[dict[str, Any]],
        micros: Sequence[Sequence[SAWItem]],
        autocast: contextlib.AbstractContextManager[Any],
    ) -> dict[str, float]:
        """The critic's no-grad values of every micro-batch (eval mode: the weights before
        the step's first update) and GAE over all of their items together (a rollout's
        items may sit in different micro-batches or minibatches): each collated
        ``batches[k]`` (holding ``micros[k]``) gets ``old_values``, ``returns`` and
        ``advantages`` ``# [B, T-1]`` on the CPU, 0 off the action tokens. Returns
        ``adv_mean`` / ``adv_std`` (over every rank's action tokens: the step's advantages
        are these, not the items' weights, which are rewards here) and ``value_time_s``."""
        t0 = time.perf_counter()
        rows: list[tuple[dict[str, Any], int, Tensor]] = []
        items: list[SAWItem] = []
        values: list[Tensor] = []
        with policies.evaluating(self.model), torch.no_grad():
            for b, micro in zip(batches, micros, strict=True):
                dev_b = {k: v.to(self.device, non_blocking=True) for k, v in b.items()}
                with autocast:
                    v = self.values(dev_b).cpu()
                on = L.token_mask(b, torch.float32) > 0  # [B, T-1]
                b[OLD_VALUES_KEY] = torch.where(on, v, torch.zeros_like(v))
                for j, it in enumerate(micro):
                    rows.append((b, j, on[j]))
                    items.append(it)
                    values.append(v[j][on[j]])
        for b in batches:
            b[L.ADVANTAGES_KEY] = torch.zeros_like(b[OLD_VALUES_KEY])
            b[RETURNS_KEY] = torch.zeros_like(b[OLD_VALUES_KEY])
        for (b, j, on), (adv, ret) in zip(rows, self.gae.per_item(items, values), strict=True):
            b[L.ADVANTAGES_KEY][j][on] = adv
            b[RETURNS_KEY][j][on] = ret
        advs = [b[L.ADVANTAGES_KEY][L.token_mask(b, torch.float32) > 0] for b in batches]
        flat = torch.cat(advs).double() if advs else torch.zeros(0, dtype=torch.float64)
        sums = [float(flat.numel()), float(flat.sum()), float((flat * flat).sum())]
        if self.distributed:
            sums = ranks.all_sum(sums, self.device)
        n, s1, s2 = sums
        mean = s1 / n if n > 0 else 0.0
        std = math.sqrt(max(s2 / n - mean * mean, 0.0)) if n > 0 else 0.0
        return {"adv_mean": mean, "adv_std": std, "value_time_s": time.perf_counter() - t0}

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the critic's gradients to ``max_norm``; the pre-clip global norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self.grad_norm = float(full_tensor(norm))
        return self.grad_norm

    def step(self, lr_factor: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * lr_factor
        self.optimizer.step()
