"""The library spec's example code runs, as the spec prints it.

ludic-training.md holds two examples a user copies: "Example Training Loop" (engine ->
RolloutBatchSource -> Trainer -> ``train``) and "Sample Filters" (``combine`` of the
``drop_*`` factories). Each is quoted below verbatim and executed with the fewest edits
that make it a program, each edit listed with its reason and required to apply (a spec
text that changes fails here instead of passing unedited): the package's name (the spec's
``ludic`` is ``libludic`` here), its ``{...}`` placeholders filled with the built-in
registries, and a budget of seconds instead of hours. The policy is the tiny model,
served in-process by ``HFChatClient`` from the very module the Trainer updates (synchronous
on-policy RL), on arithmetic.
"""

from __future__ import annotations

import ast
import copy
import warnings
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from libludic.inference.hf_client import HFChatClient
from libludic.inference.request import InferenceSpec
from libludic.inference.sampling import SamplingConfig
from libludic.registry import build_registries
from libludic.requests import EnvSpec, RolloutRequest
from tests.fakes import make_item

# ludic-training.md, "Example Training Loop"
SPEC_TRAINING_LOOP = """\
from ludic.training import (
    RolloutEngine, RolloutBatchSource, Trainer, TrainerConfig, make_grpo
)

engine = RolloutEngine(env_registry={...}, protocol_registry={...})
algo = make_grpo(group_size=8)

batch_source = RolloutBatchSource(
    engine=engine,
    request_fn=make_requests,
    algorithm=algo,
    max_steps=512,
)

trainer = Trainer(
    model=model,
    algo=algo,
    batch_source=batch_source,
    cfg=TrainerConfig(learning_rate=2e-5),
)

await trainer.train(num_steps=1000)
"""

# ludic-training.md, "Sample Filters"
SPEC_SAMPLE_FILTERS = """\
from ludic.training.filters import (
    drop_truncated,
    drop_incomplete_completions,
    drop_parse_errors,
    combine,
)

sample_filter = combine(
    drop_truncated(),
    drop_incomplete_completions(),
)
"""

PACKAGE = [("from ludic.", "from libludic.")]  # the spec's package, under this project's name
LOOP_EDITS = PACKAGE + [
    # the spec leaves the registries to the user: the built-in ones for our client
    ("env_registry={...}", "env_registry=env_registry"),
    ("protocol_registry={...}", "protocol_registry=protocol_registry"),
    ("num_steps=1000", "num_steps=STEPS"),  # seconds, not a training run
]
STEPS = 2
GROUPS = 2  # make_requests' groups per batch, 8 episodes each (the example's group_size)


def run_spec(text: str, edits: list[tuple[str, str]], namespace: dict[str, Any]) -> Any:
    """``text`` with each edit applied (each must match), executed in ``namespace``
    (top-level ``await`` allowed, as in the spec): a coroutine to await when the text
    awaits, else None."""
    for old, new in edits:
        assert old in text, f"the spec example no longer contains {old!r}"
        text = text.replace(old, new)
    code = compile(text, "<spec example>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    return eval(code, namespace)


@pytest.fixture
def policy(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return model, HFChatClient(model=model, tokenizer=tokenizer)


def make_requests() -> list[RolloutRequest]:
    """GROUPS arithmetic problems, 8 episodes of each (one GRPO group per problem)."""
    sampling = SamplingConfig(temperature=1.0, max_tokens=4)
    return [
        RolloutRequest(
            env=EnvSpec("arithmetic"),
            env_seed=g,
            sampling_seed=100 * g,
            num_episodes=8,
            same_env_seed=True,
            inference=InferenceSpec(sampling=sampling),
            meta={"group_id": f"g{g}"},
        )
        for g in range(GROUPS)
    ]


async def test_the_specs_training_loop_trains(policy) -> None:
    model, client = policy
    env_registry, protocol_registry, _ = build_registries(client)
    start = copy.deepcopy(model.state_dict())
    ns: dict[str, Any] = {
        "model": model,
        "make_requests": make_requests,
        "env_registry": env_registry,
        "protocol_registry": protocol_registry,
        "STEPS": STEPS,
    }
    with warnings.catch_warnings():  # the spec's default model_device "cuda" on a CPU host
        warnings.filterwarnings("ignore", "TrainerConfig.model_device='cuda'")
        await run_spec(SPEC_TRAINING_LOOP, LOOP_EDITS, ns)
    trainer = ns["trainer"]
    assert trainer.cfg.lr == 2e-5  # the spec's learning_rate spelling reached the optimizer
    assert trainer.optimizer.param_groups[0]["lr"] == 2e-5
    # each step trained one batch of the arithmetic episodes: 2 groups x 8, one step each
    assert trainer.step == STEPS and trainer.throughput.items_trained_total == STEPS * GROUPS * 8
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    assert moved, "two optimizer steps left every parameter where it started"


def test_the_specs_sample_filter_drops_what_it_names() -> None:
    ns: dict[str, Any] = {}
    run_spec(SPEC_SAMPLE_FILTERS, PACKAGE, ns)
    kinds = {
        "eos": {"finish_reason": "stop"},
        "max_tokens": {"finish_reason": "length"},  # drop_incomplete_completions
        "cut": {"finish_reason": "stop", "truncated": True},  # drop_truncated
        "unparsed": {"finish_reason": "stop", "parse_error": True},  # not in the combine
    }
    items = []
    for i, (name, meta) in enumerate(kinds.items()):
        it = make_item(2, 2, seed=i)
        it.meta.update(meta, item_id=name)
        items.append(it)
    kept = [it.item_id for it in items if ns["sample_filter"](it)]
    assert kept == ["eos", "unparsed"]
    assert [ns["drop_parse_errors"]()(it) for it in items] == [True, True, True, False]
