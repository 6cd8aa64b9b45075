"""parallel.meta_copy: the architecture every rank shards before rank 0's weights fill it
(parallel.shard_from_rank0; the sharding itself runs under torchrun in
tests/integration/test_fsdp2.py and test_learner_nodes.py)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from libludic.training import parallel


def test_meta_copy_holds_no_storage_keeps_ties_and_leaves_the_model(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shell = parallel.meta_copy(model)
    assert shell is not model
    tensors = [*shell.parameters(), *shell.buffers()]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    # the same names, shapes and dtypes: what set_model_state_dict fills
    assert {k: (v.shape, v.dtype) for k, v in shell.state_dict().items()} == {
        k: (v.shape, v.dtype) for k, v in before.items()
    }
    # the tied head is still one parameter (FSDP2 shards it once, the root owns it)
    assert shell.lm_head.weight is shell.model.embed_tokens.weight
    assert not shell.model.layers[0].mlp.up_proj.weight.requires_grad
    assert shell.model.layers[0].mlp.down_proj.weight.requires_grad
    # the model passed in is untouched
    assert all(t.device.type == "cpu" for t in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
