"""docs/areal-coverage.md against the code: every AReaL option the table calls present is set
from a run config and reaches the component that uses it.

One run config sets every present key to a value other than its default (:data:`CASES`, our
key -> test value and where to read it back); a second one holds the one option that would
make others inert in the first (``optimizer_type: sgd`` ignores ``betas`` and ``eps``). Each
config is loaded the way ``ludic up`` loads it: the launcher's ``up:`` settings, then the
learner's and the feeder's (services/launcher/resolved.py, the learner given its model and
output directory as the launcher gives them), the actors', credit's and the eval service's,
and inference's with ``--model-dir`` from the launcher's ``prepare_model``. The values are
then read where the run uses them: the learner's TrainerConfig, the preset's loss and credit
as credit and learner build them, a task's sampling body, ``wandb.init`` / ``swanlab.init``
(fakes) and TensorBoard's writer through the learner's StepLogger, vLLM's flags, the
launcher's and the services' settings. A present row without a case fails, so does a case
without a row, and so do summary counts that disagree with the rows.
"""

from __future__ import annotations

import copy
import re
import shutil
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import yaml

from libludic.training.filters import drop_zero_variance_groups
from libludic.training.normalization import NormConfig
from services.common.settings import load_settings
from services.inference.settings import InferenceSettings
from services.inference.worker import platform_default_args
from services.launcher.resolved import Resolved, service_environ
from services.launcher.settings import UpSettings
from services.launcher.worker import prepare_model
from services.learner import metrics as M
from services.learner.worker import load_policy

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "areal-coverage.md"
SAMPLE = str(REPO / "examples" / "gsm8k" / "gsm8k_sample.jsonl")
STATUSES = ("present", "absent", "n.a.")
SUMMARY = re.compile(
    r"\*\*Present (\d+), absent (\d+), not applicable (\d+): "
    r"coverage (\d+) / (\d+) = (\d+\.\d)%\.\*\*"
)


@dataclass(frozen=True)
class Row:
    group: str
    option: str
    key: str  # "" where absent or n.a.
    status: str


def table() -> list[Row]:
    """The table's rows; a line that is not a well-formed row is an error."""
    rows = []
    lines = DOC.read_text().splitlines()
    start = lines.index(
        "| AReaL group | option | AReaL default | our key | our default | status | note |"
    )
    assert lines[start + 1] == "|---|---|---|---|---|---|---|"
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 7, f"not 7 cells: {line}"
        group, option, _, key, _, status, _ = cells
        assert status in STATUSES, f"status {status!r}: {line}"
        if status == "present":
            assert re.fullmatch(r"`[^`]+`", key), f"a present row names one key: {line}"
        else:
            assert key == "—", f"an {status} row names no key: {line}"
        rows.append(Row(group, option.strip("`"), key.strip("`") if key != "—" else "", status))
    return rows


ROWS = table()
PRESENT = sorted({r.key for r in ROWS if r.status == "present"})


class Loaded:
    """One run config, loaded as ``ludic up`` loads it; the properties are where the run
    reads each value."""

    def __init__(self, path: Path, tmp: Path) -> None:
        self.tmp = tmp
        self.up = load_settings(UpSettings, ["--config", str(path)], service="up", environ={})
        self.model_dir = prepare_model(self.up, tmp / "run")  # the launcher's starting policy
        resolved = Resolved.of(self.up, {"LUDIC_MODEL_DIR": str(self.model_dir)})
        self.learner, self.feeder = resolved.learner, resolved.feeder
        self.actor = Resolved.actor(self.up, {})
        others = Resolved.others(self.up, {})
        self.credit, self.eval = others["credit"], others["eval"]
        self.inference = load_settings(
            InferenceSettings,
            ["--model-dir", str(self.model_dir)],
            service="inference",
            environ=service_environ(self.up.config_path, {}),
        )
        wandb, swanlab = sys.modules["wandb"], sys.modules["swanlab"]
        logger = M.StepLogger(
            self.learner.trackers,
            run_id=self.learner.run_id,
            output_dir=self.learner.output_dir,
        )
        logger.close()
        self.wandb_init: dict[str, Any] = wandb.inits.pop() if wandb.inits else {}
        self.swanlab_init: dict[str, Any] = swanlab.inits.pop() if swanlab.inits else {}
        self.tensorboard_dir = logger.tb.log_dir if logger.tb is not None else None

    @cached_property
    def trainer(self) -> Any:
        return self.learner.trainer_config()

    @cached_property
    def credit_algo(self) -> Any:
        return self.credit.spec.build()

    @property
    def credit_assigner(self) -> Any:
        return self.credit_algo.credit_assigner

    @cached_property
    def loss(self) -> Any:
        return self.learner.spec.build().loss

    @property
    def body(self) -> dict[str, Any]:
        """The sampling fields of a request of the feeder's task (what the server gets)."""
        bodies = [
            t.inference.sampling.to_openai()
            for t in (self.feeder.parsed_tasks[0], self.actor.task_set.tasks[0])
        ]
        assert bodies[0] == bodies[1]  # the actors run the feeder's task
        return bodies[0]

    @property
    def vllm_argv(self) -> list[str]:
        return platform_default_args(list(self.inference.vllm_args), is_cpu=False)


SAME = object()  # expect the value the config sets


@dataclass(frozen=True)
class Case:
    """A present key's test value (a callable: of the test's directory) and where the run
    reads it back; ``expect`` when the component holds it in another form; ``config`` 1 for
    the options kept out of the main config."""

    value: Any
    read: Callable[[Loaded], Any]
    expect: Any = SAME
    config: int = 0


def tc(name: str, value: Any, expect: Any = SAME, config: int = 0) -> Case:
    """A TrainerConfig field."""
    return Case(value, lambda x: getattr(x.trainer, name), expect, config)


def body(name: str, value: Any, expect: Any = SAME) -> Case:
    """A field of the sampling body a task's requests carry."""
    return Case(value, lambda x: x.body[name], expect)


def shaping(name: str, value: Any) -> Case:
    """A reward-shaping option, applied where credit builds the algorithm."""
    return Case(value, lambda x: getattr(x.credit_algo.reward_shaping, name))


def off_policy(name: str, value: Any) -> Case:
    """An off-policy option of the learner's loss."""
    return Case(value, lambda x: getattr(x.loss.off_policy, name))


def reward_norm(name: str, value: Any) -> Case:
    return Case(value, lambda x: getattr(x.credit_assigner.reward_norm, name))


def vllm_flag(flag: str, value: Any) -> Case:
    """A flag passed through ``inference.vllm_args`` to vLLM's engine."""
    item = flag if value is True else f"{flag}={value}"
    return Case(value, lambda x: item in x.vllm_argv, True)


def wandb(name: str, value: Any, field: str | None = None, expect: Any = SAME) -> Case:
    return Case(value, lambda x: x.wandb_init[field or name], expect)


def swanlab(name: str, value: Any, field: str | None = None) -> Case:
    return Case(value, lambda x: x.swanlab_init[field or name])


KW = "algorithm.kwargs."
SP = "feeder.tasks[].inference.sampling."
VA = "inference.vllm_args"

#: every present key of the table -> its test value (never the default) and where it lands
CASES: dict[str, Case] = {
    # the launcher and the run
    "up.name": Case("cov-run", lambda x: Path(x.learner.output_dir).parent.name),
    "run_id": Case(
        "cov-7",
        lambda x: {s.run_id for s in (x.up, x.learner, x.feeder, x.actor, x.credit, x.eval)},
        {"cov-7"},
    ),
    "up.runs_dir": Case(
        lambda tmp: str(tmp / "runs"), lambda x: str(Path(x.learner.output_dir).parents[1])
    ),
    "up.learner_nproc": Case(2, lambda x: x.up.learner_nproc),
    "up.learner_threads": Case(3, lambda x: x.up.learner_threads),
    "up.model": Case(lambda tmp: str(tmp / "model"), lambda x: str(x.model_dir)),
    "up.eval_env": Case(
        {"kind": "dataset_qa", "kwargs": {"path": SAMPLE, "format": "gsm8k"}},
        lambda x: [s.env for s in (*x.up.parsed_eval_sets, *x.eval.parsed_sets)],
        [{"kind": "dataset_qa", "kwargs": {"path": SAMPLE, "format": "gsm8k"}}] * 2,
    ),
    "up.eval_every_steps": Case(4, lambda x: (x.up.eval_every_steps, x.eval.every_steps), (4, 4)),
    "up.max_restarts": Case(2, lambda x: x.up.max_restarts),
    "up.startup_timeout_s": Case(60.0, lambda x: x.up.startup_timeout_s),
    "max_head_offpolicyness": Case(
        0, lambda x: (x.feeder.max_head_offpolicyness, x.actor.max_head_offpolicyness), (0, 0)
    ),
    # the feeder and the actors
    "feeder.tasks[].env.kwargs.path": Case(
        SAMPLE,
        lambda x: [
            t.env.kwargs["path"] for t in (x.feeder.parsed_tasks[0], *x.actor.task_set.tasks)
        ],
        [SAMPLE, SAMPLE],
    ),
    "feeder.high_water": Case(16, lambda x: x.feeder.high_water),
    "actor.concurrency": Case(2, lambda x: x.actor.concurrency),
    "actor.inference_timeout_s": Case(600.0, lambda x: x.actor.inference_timeout_s),
    "actor.request_retries": Case(3, lambda x: x.actor.request_retries),
    SP + "max_tokens": body("max_tokens", 64),
    SP + "min_tokens": body("min_tokens", 4),
    SP + "temperature": body("temperature", 0.0),
    SP + "top_p": body("top_p", 0.9),
    SP + "top_k": body("top_k", 20),
    SP + "stop_token_ids": body("stop_token_ids", [7, 9]),
    SP + "stop": body("stop", ["\n\n"]),
    SP + "frequency_penalty": body("frequency_penalty", 0.5),
    # the algorithm, as credit and learner build it
    "algorithm.group_size": Case(
        4,
        lambda x: (x.feeder.group_size, x.credit_assigner.group_size, x.learner.spec.group_size),
        (4, 4, 4),
    ),
    KW + "eps_clip": Case(0.1, lambda x: x.loss.eps_clip),
    KW + "eps_clip_higher": Case(0.3, lambda x: x.loss.eps_clip_higher),
    KW + "c_clip": Case(3.0, lambda x: x.loss.c_clip),
    KW + "reward_scaling": shaping("reward_scaling", 2.0),
    KW + "reward_bias": shaping("reward_bias", -0.5),
    KW + "reward_clip": shaping("reward_clip", 5.0),
    KW + "overlong_reward_penalty": shaping("overlong_reward_penalty", True),
    KW + "overlong_tokens": shaping("overlong_tokens", 16),
    KW + "overlong_penalty_factor": shaping("overlong_penalty_factor", 0.5),
    KW + "max_new_tokens": Case(
        64, lambda x: (x.credit_algo.reward_shaping.max_new_tokens, x.loss.max_new_tokens), (64, 64)
    ),
    KW + "mask_no_eos_with_zero": Case(True, lambda x: x.credit_algo.mask_no_eos_with_zero),
    KW + "gamma": Case(0.9, lambda x: x.credit_assigner.gamma),
    KW + "reward_norm": Case({}, lambda x: x.credit_assigner.reward_norm is not None, True),
    KW + "reward_norm.mean_level": reward_norm("mean_level", "group"),
    KW + "reward_norm.mean_leave1out": reward_norm("mean_leave1out", True),
    KW + "reward_norm.std_level": reward_norm("std_level", "group"),
    KW + "reward_norm.std_unbiased": reward_norm("std_unbiased", False),
    KW + "reward_norm.eps": reward_norm("eps", 1e-3),
    KW + "adv_norm": Case(
        {"mean_level": "batch", "std_level": None},
        lambda x: x.credit_assigner.adv_norm,
        NormConfig(mean_level="batch", std_level=None),
    ),
    KW + "kl_coeff": Case(0.05, lambda x: x.loss.kl_in_reward.coeff),
    KW + "kl_estimator": Case("k1", lambda x: x.loss.kl_in_reward.estimator),
    KW + "recompute_logprob": off_policy("recompute_logprob", True),
    KW + "use_decoupled_loss": off_policy("use_decoupled_loss", True),
    KW + "behav_imp_weight_cap": off_policy("behav_imp_weight_cap", 5.0),
    KW + "dynamic_sampling": Case(
        True, lambda x: x.credit_algo.preprocess, drop_zero_variance_groups
    ),
    "algorithm.ppo_n_minibatches": tc("ppo_n_minibatches", 2),
    "algorithm.gradient_checkpointing": tc("gradient_checkpointing", True),
    "algorithm.lr_scheduler_type": tc("lr_scheduler_type", "cosine"),
    "algorithm.warmup_steps_proportion": tc("warmup_steps_proportion", 0.05),
    "algorithm.min_lr_ratio": tc("min_lr_ratio", 0.1),
    # the learner
    "learner.num_steps": tc("total_steps", 200),
    "learner.seed": Case(7, lambda x: x.learner.seed),
    "learner.batch_size": Case(32, lambda x: x.learner.batch_size),
    "learner.snapshot_every": Case(5, lambda x: x.learner.snapshot_every),
    "learner.checkpoint_every": Case(5, lambda x: x.learner.checkpoint_config().every_n_steps),
    "learner.resume": Case(True, lambda x: x.learner.resume),
    "learner.attn_impl": Case(
        "eager", lambda x: load_policy(x.learner, weights=False).config._attn_implementation
    ),
    "learner.publish_plane": Case("collective", lambda x: x.learner.publish_plane),
    "learner.mixed_precision": tc("mixed_precision_dtype", "fp32"),
    "learner.lr": tc("lr", 3e-5),
    "learner.weight_decay": tc("weight_decay", 0.05),
    "learner.max_grad_norm": tc("max_grad_norm", 0.5),
    "learner.micro_token_budget": tc("micro_token_budget", 4096),
    "learner.lora_rank": tc("lora_rank", 4),
    "learner.trainer.lora_alpha": tc("lora_alpha", 8.0),
    "learner.trainer.lora_target_modules": tc(
        "lora_target_modules", ["q_proj", "v_proj"], ("q_proj", "v_proj")
    ),
    "learner.trainer.disable_dropout": tc("disable_dropout", True),
    "learner.trainer.min_micro_batches": tc("min_micro_batches", 2),
    "learner.trainer.betas": tc("betas", [0.8, 0.95], (0.8, 0.95)),
    "learner.trainer.eps": tc("eps", 1e-6),
    "learner.trainer.optimizer_type": tc("optimizer_type", "sgd", config=1),
    # the trackers, as the learner's step logger starts them
    "tracker.wandb.mode": wandb("mode", "offline"),
    "tracker.wandb.wandb_base_url": Case(
        "https://wandb.example.org", lambda x: x.wandb_init["settings"].kw["base_url"]
    ),
    "tracker.wandb.entity": wandb("entity", "team"),
    "tracker.wandb.project": wandb("project", "cov"),
    "tracker.wandb.name": wandb("name", "trial-a"),
    "tracker.wandb.job_type": wandb("job_type", "train"),
    "tracker.wandb.group": wandb("group", "sweep"),
    "tracker.wandb.notes": wandb("notes", "coverage"),
    "tracker.wandb.tags": wandb("tags", ["grpo", "cov"]),
    "tracker.wandb.id_suffix": wandb("id_suffix", "t1", field="id", expect="cov-7_t1"),
    "tracker.swanlab.mode": swanlab("mode", "local"),
    "tracker.swanlab.project": swanlab("project", "cov"),
    "tracker.swanlab.name": swanlab("name", "trial-b", field="experiment_name"),
    "tracker.swanlab.logdir": swanlab("logdir", lambda tmp: str(tmp / "swanlog")),
    "tracker.tensorboard.path": Case(lambda tmp: str(tmp / "tb"), lambda x: x.tensorboard_dir),
    # inference, and vLLM's own flags
    "inference.seed": Case(3, lambda x: x.inference.seed),
    "inference.enforce_eager": Case(True, lambda x: x.inference.enforce_eager),
    "inference.dtype": Case("bfloat16", lambda x: x.inference.dtype),
    "inference.max_model_len": Case(512, lambda x: x.inference.max_model_len),
    "inference.gpu_memory_utilization": Case(0.5, lambda x: x.inference.gpu_memory_utilization),
    "inference.log_level": Case("warning", lambda x: x.inference.log_level),
    VA + "[--distributed-executor-backend]": vllm_flag("--distributed-executor-backend", "mp"),
    VA + "[--max-num-seqs]": vllm_flag("--max-num-seqs", 64),
    VA + "[--block-size]": vllm_flag("--block-size", 32),
    VA + "[--cpu-offload-gb]": vllm_flag("--cpu-offload-gb", 2),
    VA + "[--disable-sliding-window]": vllm_flag("--disable-sliding-window", True),
    VA + "[--enable-chunked-prefill]": vllm_flag("--enable-chunked-prefill", True),
    VA + "[--enable-prefix-caching]": vllm_flag("--enable-prefix-caching", True),
}

#: what the cases need besides their own keys: a task to train on (its dataset is a present
#: key), the KL as AReaL's reward penalty (kl_coeff's reading), an eval service section
BASE: dict[str, Any] = {
    "algorithm": {"name": "grpo", "kwargs": {"kl_in_reward": True}},
    "feeder": {
        "tasks": [
            {
                "name": "qa",
                "env": {"kind": "dataset_qa", "kwargs": {"format": "gsm8k"}},
                "protocol": {"kind": "single_agent", "kwargs": {"parser": "boxed"}},
            }
        ]
    },
    "eval": {},
}


def put(doc: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` (``a.b[].c``: the first entry of list ``b``; ``a[--flag]``: the flag, with
    its value, appended to list ``a``) in ``doc``."""
    node: Any = doc
    *path, last = key.split(".")
    for part in path:
        name, index = re.fullmatch(r"(\w+)(\[\])?", part).groups()
        node = node.setdefault(name, [{}])[0] if index else node.setdefault(name, {})
    m = re.fullmatch(r"(\w+)\[(--[\w-]+)\]", last)
    if m:
        flags = node.setdefault(m.group(1), [])
        flags.append(m.group(2) if value is True else f"{m.group(2)}={value}")
    else:
        node[last] = value


def run_config(tmp: Path, config: int) -> dict[str, Any]:
    """The main config (0) with every case of its own; config 1: the main one with the
    cases of config 1 over it."""
    doc = copy.deepcopy(BASE)
    wanted = [(k, c) for k, c in CASES.items() if c.config in (0, config)]
    for key, case in sorted(wanted, key=lambda kc: kc[0].count(".")):  # a mapping before its keys
        value = case.value(tmp) if callable(case.value) else case.value
        put(doc, key, copy.deepcopy(value))
    return doc


class FakeTracker(types.ModuleType):
    """``wandb`` / ``swanlab`` as the step logger uses them: ``init`` records its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.inits: list[dict[str, Any]] = []

    def init(self, **kw: Any) -> None:
        self.inits.append(kw)

    def finish(self) -> None:
        pass

    class Settings:
        def __init__(self, **kw: Any) -> None:
            self.kw = kw


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[Loaded]:
    """Each run config, loaded (the tiny model copied where ``up.model`` points)."""
    out = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("wandb", "swanlab"):
            mp.setitem(sys.modules, name, FakeTracker(name))
        for var in ("WANDB_PROJECT", "WANDB_MODE"):
            mp.delenv(var, raising=False)
        for config in (0, 1):
            tmp = tmp_path_factory.mktemp(f"coverage{config}")
            shutil.copytree(tiny_model_dir, tmp / "model")
            doc = run_config(tmp, config)
            path = tmp / "run.yaml"
            path.write_text(yaml.safe_dump(doc))
            out.append(Loaded(path, tmp))
    return out


@pytest.mark.parametrize("key", PRESENT)
def test_a_present_option_reaches_its_component(key: str, loaded: list[Loaded]) -> None:
    assert key in CASES, (
        f"docs/areal-coverage.md calls {key!r} present: give it a test value in CASES "
        "(not its default) and where the run reads it"
    )
    case = CASES[key]
    x = loaded[case.config]
    want = case.expect
    if want is SAME:
        want = case.value(x.tmp) if callable(case.value) else case.value
    assert case.read(x) == want


def test_every_case_is_a_present_row() -> None:
    stale = sorted(set(CASES) - set(PRESENT))
    assert not stale, f"CASES holds keys no present row of docs/areal-coverage.md names: {stale}"


def test_the_summary_counts_the_rows() -> None:
    m = SUMMARY.search(DOC.read_text())
    assert m, "docs/areal-coverage.md has no summary line"
    present, absent, na, num, den = (int(g) for g in m.groups()[:5])
    counts = {s: sum(r.status == s for r in ROWS) for s in STATUSES}
    assert (present, absent, na) == (counts["present"], counts["absent"], counts["n.a."])
    assert (num, den) == (present, present + absent)
    assert m.group(6) == f"{100 * present / (present + absent):.1f}"


def test_each_option_has_one_row() -> None:
    seen = [(r.group, r.option) for r in ROWS]
    assert len(seen) == len(set(seen)), sorted({s for s in seen if seen.count(s) > 1})
    assert len(ROWS) > 200  # the whole reference, SGLang's options included
