"""One algorithm per run: the top-level ``algorithm:`` section, read by feeder, credit and
learner; per-service copies are errors that say where to move them."""

from __future__ import annotations

from pathlib import Path

import pytest

from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.presets import ALGORITHMS
from services.common.settings import load_settings
from services.credit.settings import CreditSettings
from services.feeder.settings import FeederSettings
from services.learner.settings import LearnerSettings
from tests.example_configs import run_configs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = run_configs()
DEPLOY = ROOT / "deploy" / "compose" / "ludic.yaml"


def load(cls, path: Path, service: str, environ=None):
    return load_settings(cls, ["--config", str(path)], service=service, environ=environ or {})


@pytest.mark.parametrize("path", EXAMPLES + [DEPLOY], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_run_config_gives_feeder_credit_and_learner_one_algorithm(path: Path) -> None:
    f = load(FeederSettings, path, "feeder")
    c = load(CreditSettings, path, "credit")
    lr = load(LearnerSettings, path, "learner")
    assert c.spec == lr.spec
    assert f.group_size == c.spec.group_size == lr.spec.group_size
    assert c.spec.name in ALGORITHMS


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text,copy,target",
    [
        ("credit:\n  group_size: 4\n", "credit.group_size", "algorithm.group_size"),
        ("feeder:\n  group_size: 4\n", "feeder.group_size", "algorithm.group_size"),
        ("credit:\n  algorithm: grpo\n", "credit.algorithm", "algorithm.name"),
        ("learner:\n  algorithm: grpo\n", "learner.algorithm", "algorithm.name"),
        (
            "learner:\n  algorithm_kwargs: {kl_coeff: 0.1}\n",
            "learner.algorithm_kwargs",
            "algorithm.kwargs",
        ),
    ],
)
@pytest.mark.parametrize(
    "cls,service",
    [(FeederSettings, "feeder"), (CreditSettings, "credit"), (LearnerSettings, "learner")],
)
def test_a_per_service_copy_is_an_error_naming_the_fix(
    tmp_path, text, copy, target, cls, service
) -> None:
    p = write(tmp_path, "algorithm: {name: grpo, group_size: 4}\n" + text)
    with pytest.raises(
        ValueError, match=rf"move {copy} to the top-level algorithm: section as {target}"
    ):
        load(cls, p, service)


def test_top_level_leftovers_and_retired_env_are_errors(tmp_path) -> None:
    with pytest.raises(
        ValueError, match="move it to the top-level algorithm: section as algorithm.group_size"
    ):
        load(CreditSettings, write(tmp_path, "group_size: 4\n"), "credit")
    with pytest.raises(
        ValueError, match="LUDIC_GROUP_SIZE='4' is no longer read.*algorithm.group_size"
    ):
        load(CreditSettings, write(tmp_path, "run_id: x\n"), "credit", {"LUDIC_GROUP_SIZE": "4"})


def test_ppo_is_refused_by_credit_and_learner_with_the_way_out(tmp_path) -> None:
    p = write(tmp_path, "algorithm: {name: ppo, kwargs: {gamma: 0.99, gae_lambda: 0.95}}\n")
    for cls, service in ((CreditSettings, "credit"), (LearnerSettings, "learner")):
        with pytest.raises(
            ValueError,
            match=rf"{service}: algorithm.name='ppo' trains a critic \(PPO with GAE\), which the "
            r"services do not carry yet.*libludic's Trainer \(RolloutBatchSource\)",
        ):
            load(cls, p, service)


def test_algorithm_section_values_are_checked_with_the_key_named(tmp_path) -> None:
    def bad(text: str, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            load(CreditSettings, write(tmp_path, text), "credit")

    bad("algorithm: grpo\n", "algorithm: must be a mapping")
    bad(
        "algorithm: {name: trpo}\n",
        r"algorithm.name='trpo'; use one of \['cispo', 'custom', 'dapo', 'dr_grpo', 'grpo', 'gspo'",
    )
    bad("algorithm: {name: grpo, kwargs: {group_size: 4}}\n", "move it to algorithm.group_size")
    # PPO with a critic is the library's alone for now: refused where the services read it
    bad("algorithm: {name: ppo}\n", r"credit: algorithm.name='ppo' trains a critic .*not carry")
    bad(
        "algorithm: {name: grpo, kwargs: {kl_coef: 0.1}}\n",
        r"\['kl_coef'\] are not arguments of make_grpo",
    )
    bad("algorithm: {name: grpo, kwargs: {kl_coeff: -1}}\n", "kl_coeff=-1 must be >= 0")
    bad(
        "algorithm: {name: grpo, group_size: 0}\n", "algorithm.group_size=0 must be an integer >= 1"
    )
    bad(
        "algorithm: {name: grpo, kl_coeff: 0.1}\n",
        "preset arguments such as kl_coeff go under kwargs",
    )
    # the optimisation options: one level up from kwargs, each value checked
    bad(
        "algorithm: {name: grpo, kwargs: {ppo_n_minibatches: 2}}\n",
        r"algorithm.kwargs \['ppo_n_minibatches'\] are optimisation options.*to "
        "algorithm.ppo_n_minibatches",
    )
    bad(
        "algorithm: {lr_scheduler_type: step}\n",
        r"algorithm.lr_scheduler_type='step'; use one of \['constant', 'linear', 'cosine'\]",
    )
    bad("algorithm: {warmup_steps_proportion: 1.0}\n", "algorithm.warmup_steps_proportion=1.0")
    bad("algorithm: {min_lr_ratio: 2}\n", r"algorithm.min_lr_ratio=2 must be in \[0, 1\]")
    bad("algorithm: {ppo_n_minibatches: 0}\n", "algorithm.ppo_n_minibatches=0 must be an integer")
    bad("algorithm: {gradient_checkpointing: 1}\n", "algorithm.gradient_checkpointing=1 must be")


def test_spec_builds_the_preset_with_the_group_size_once() -> None:
    spec = AlgorithmSpec.from_mapping(
        {"name": "scalerl", "group_size": 4, "kwargs": {"filter_zvp": False}}
    )
    algo = spec.build()
    assert (
        algo.name == "scalerl" and algo.credit_assigner.group_size == 4 and algo.preprocess is None
    )
    assert spec.build(group_size=3).credit_assigner.group_size == 3  # a partial group
    assert AlgorithmSpec.from_mapping({"name": "sft"}).build().name == "sft"  # no group_size arg
    assert AlgorithmSpec.from_mapping(None) == AlgorithmSpec("grpo", 8, {})
    kl = AlgorithmSpec.from_mapping({"name": "grpo", "kwargs": {"kl_coeff": 0.05}}).build()
    assert kl.needs_ref_logprobs and not AlgorithmSpec().build().needs_ref_logprobs


def test_env_and_flag_carry_the_section_as_json(tmp_path) -> None:
    c = load_settings(
        CreditSettings,
        ["--algorithm", '{"name": "cispo", "group_size": 2}'],
        service="credit",
        environ={},
    )
    assert (c.spec.name, c.spec.group_size) == ("cispo", 2)
    f = load_settings(
        FeederSettings, [], service="feeder", environ={"LUDIC_ALGORITHM": '{"group_size": 3}'}
    )
    assert f.group_size == 3


def test_ludic_up_refuses_a_bad_algorithm_before_starting_anything(tmp_path, capsys) -> None:
    from services.launcher.main import main as up_main

    p = write(tmp_path, "algorithm: {name: grpo, kwargs: {kl_coef: 0.1}}\n")
    assert up_main(["--config", str(p)]) == 2
    assert "['kl_coef'] are not arguments of make_grpo" in capsys.readouterr().err
    p = write(tmp_path, "learner:\n  algorithm_kwargs: {group_size: 8}\n")
    with pytest.raises(
        ValueError, match="move learner.algorithm_kwargs to the top-level algorithm: section"
    ):
        up_main(["--config", str(p)])


def test_algorithm_options_reach_credit_and_learner_from_the_run_config(tmp_path) -> None:
    p = write(
        tmp_path,
        "algorithm:\n  name: grpo\n  group_size: 4\n  kwargs:\n    dynamic_sampling: true\n",
    )
    c = load(CreditSettings, p, "credit")
    lr = load(LearnerSettings, p, "learner")
    assert c.spec == lr.spec and c.spec.kwargs == {"dynamic_sampling": True}
    assert c.spec.build().dynamic_sampling and c.spec.build(group_size=3).dynamic_sampling
    env = load_settings(
        CreditSettings,
        [],
        service="credit",
        environ={
            "LUDIC_ALGORITHM": '{"name": "cispo", "group_size": 2, "kwargs": {"dynamic_sampling": true}}'
        },
    )
    assert env.spec.build().dynamic_sampling


def test_reward_options_reach_credit_and_learner_from_the_run_config(tmp_path) -> None:
    p = write(
        tmp_path,
        "algorithm:\n  name: dr_grpo\n  group_size: 4\n  kwargs:\n"
        "    overlong_reward_penalty: true\n    overlong_tokens: 256\n"
        "    overlong_penalty_factor: 1.0\n    reward_scaling: 0.5\n"
        "    reward_bias: 1.0\n    reward_clip: 10.0\n    mask_no_eos_with_zero: true\n",
    )
    c = load(CreditSettings, p, "credit")
    assert c.spec == load(LearnerSettings, p, "learner").spec
    algo = c.spec.build()
    sh = algo.reward_shaping
    assert (sh.overlong_tokens, sh.overlong_penalty_factor, sh.max_new_tokens) == (256, 1.0, 1024)
    assert (sh.reward_scaling, sh.reward_bias, sh.reward_clip) == (0.5, 1.0, 10.0)
    assert algo.mask_no_eos_with_zero
    with pytest.raises(ValueError, match="overlong_reward_penalty needs max_new_tokens"):
        load(
            CreditSettings,
            write(
                tmp_path,
                "algorithm: {name: grpo, kwargs: "
                "{overlong_reward_penalty: true, overlong_tokens: 4, "
                "overlong_penalty_factor: 1.0}}\n",
            ),
            "credit",
        )


def test_normalisation_options_reach_credit_and_learner_from_the_run_config(tmp_path) -> None:
    from libludic.training.credit_assignment import NormalizedReturn
    from libludic.training.normalization import NormConfig

    p = write(
        tmp_path,
        "algorithm:\n  name: grpo\n  group_size: 4\n  kwargs:\n"
        "    reward_norm: {mean_level: group, mean_leave1out: true, std_level: null}\n"
        "    adv_norm: {mean_level: batch, std_level: batch, std_unbiased: false, eps: 1.0e-6}\n",
    )
    c = load(CreditSettings, p, "credit")
    assert c.spec == load(LearnerSettings, p, "learner").spec
    ca = c.spec.build().credit_assigner
    assert isinstance(ca, NormalizedReturn) and ca.needs_batch_stage
    assert ca.reward_norm == NormConfig("group", True, None, True, 1e-5)
    assert ca.adv_norm == NormConfig("batch", False, "batch", False, 1e-6)
    assert c.spec.build().has_batch_stage  # credit defers it, the learner finishes it
    with pytest.raises(ValueError, match="reward_norm.group_size=4"):
        load(
            CreditSettings,
            write(
                tmp_path,
                "algorithm: {name: grpo, kwargs: "
                "{reward_norm: {mean_level: group, group_size: 4}}}\n",
            ),
            "credit",
        )
