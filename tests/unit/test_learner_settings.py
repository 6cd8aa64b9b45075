"""Learner settings: checkpointing on/off decides when SAW items are acked."""

import pytest

from services.credit.settings import CreditSettings
from services.learner.settings import LearnerSettings


def test_checkpoint_every_zero_means_no_checkpointing_even_with_output_dir(tmp_path):
    # with a checkpoint config the learner acks only at checkpoints; with every_n_steps=0
    # those never come and the credit worker's backpressure would stall the run for good
    s = LearnerSettings(output_dir=str(tmp_path), checkpoint_every=0, device="cpu")
    assert s.checkpoint_config() is None
    on = LearnerSettings(
        output_dir=str(tmp_path), checkpoint_every=5, device="cpu"
    ).checkpoint_config()
    assert on is not None and on.every_n_steps == 5


def test_resume_needs_periodic_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every > 0"):
        LearnerSettings(output_dir=str(tmp_path), checkpoint_every=0, resume=True, device="cpu")


@pytest.mark.parametrize(
    "key, fix",
    [
        ("lr", r"learner.trainer.lr: set it as learner.lr, its one name"),
        ("learning_rate", r"learner.trainer.learning_rate: set it as learner.lr"),
        ("model_device", r"set it as learner.device"),
        ("mixed_precision_dtype", r"set it as learner.mixed_precision"),
        ("total_steps", r"set it as learner.num_steps"),
        ("ppo_n_minibatches", r"set it as algorithm.ppo_n_minibatches \(the top-level"),
        ("lr_scheduler_type", r"set it as algorithm.lr_scheduler_type"),
        ("gradient_checkpointing", r"set it as algorithm.gradient_checkpointing"),
    ],
)
def test_a_trainer_field_has_one_name_and_another_spelling_names_it(key, fix):
    with pytest.raises(ValueError, match=fix):
        LearnerSettings(device="cpu", trainer={key: 1})


def test_the_trainer_map_holds_the_fields_without_another_name():
    s = LearnerSettings(device="cpu", trainer={"betas": [0.9, 0.95], "pad_token_id": 3})
    assert s.trainer_config().betas == (0.9, 0.95) and s.trainer_config().pad_token_id == 3
    with pytest.raises(ValueError, match=r"unknown TrainerConfig key\(s\) \['learnig_rate'\]"):
        LearnerSettings(device="cpu", trainer={"learnig_rate": 3e-4})


def test_the_optimisation_options_come_from_the_algorithm_section():
    s = LearnerSettings(
        device="cpu",
        num_steps=40,
        algorithm={
            "name": "grpo",
            "lr_scheduler_type": "cosine",
            "warmup_steps_proportion": 0.1,
            "min_lr_ratio": 0.5,
            "ppo_n_minibatches": 2,
            "gradient_checkpointing": True,
        },
    )
    cfg = s.trainer_config()
    assert cfg.total_steps == 40 and cfg.ppo_n_minibatches == 2 and cfg.gradient_checkpointing
    # W = int(0.1 * 40) = 4 warmup steps at 1/4 .. 4/4 of lr, then the cosine from lr down to
    # min_lr_ratio * lr: half-way through the decay (step 4 + 18 = 22 of 36 decay steps,
    # p = 0.5) the factor is 0.5 + 0.5 * (1 + cos(pi / 2)) / 2 = 0.75
    assert cfg.lr_at(0) == s.lr / 4 and cfg.lr_at(4) == s.lr
    assert cfg.lr_at(22) == pytest.approx(0.75 * s.lr) and cfg.lr_at(40) == 0.5 * s.lr
    with pytest.raises(ValueError, match=r"lr_scheduler_type='linear' decays over the run: set"):
        LearnerSettings(device="cpu", algorithm={"lr_scheduler_type": "linear"})


def test_ack_window_larger_than_credits_high_water_is_refused(tmp_path):
    from services.learner.settings import load

    cfg = tmp_path / "run.yaml"
    cfg.write_text("credit: {saw_high_water: 128}\n")
    base = ["--config", str(cfg), "--output-dir", str(tmp_path), "--device", "cpu"]
    base += ["--batch-size", "64"]
    ok = load([*base, "--checkpoint-every", "2"], environ={})
    # credit's value, read from credit's section of the same file
    assert ok.saw_high_water == 128 and ok.checkpoint_config().every_n_steps == 2  # 128 <= 128
    with pytest.raises(
        ValueError, match=r"checkpoint_every=3 x batch_size=64 = 192 items.*saw_high_water=128"
    ):
        load([*base, "--checkpoint-every", "3"], environ={})
    # credit's environment variable is the learner's too
    assert load([*base, "--checkpoint-every", "3"], environ={"LUDIC_SAW_HIGH_WATER": "192"})
    # without checkpoints items are acked after every step: no window
    LearnerSettings(checkpoint_every=3, batch_size=64, device="cpu", saw_high_water=128)
    # credit's default high water (4096) applies when the config has no credit section
    cfg.write_text("learner: {}\n")
    with pytest.raises(ValueError, match="saw_high_water=4096"):
        load([*base, "--checkpoint-every", "65"], environ={})
    assert CreditSettings().saw_high_water == LearnerSettings().saw_high_water == 4096


def test_the_optimisation_options_follow_one_precedence(tmp_path):
    """The algorithm: section, with its optimisation options, comes from one source: the
    YAML's, replaced whole by LUDIC_ALGORITHM, replaced whole by --algorithm."""
    from services.learner.settings import load

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "algorithm: {name: grpo, ppo_n_minibatches: 2}\n"
        "learner: {device: cpu, num_steps: 10, trainer: {eps: 1.0e-6}}\n"
    )
    assert load(["--config", str(cfg)], environ={}).trainer_config().ppo_n_minibatches == 2
    env = {"LUDIC_ALGORITHM": '{"name": "grpo", "ppo_n_minibatches": 3}'}
    assert load(["--config", str(cfg)], environ=env).trainer_config().ppo_n_minibatches == 3
    flag = ["--algorithm", '{"ppo_n_minibatches": 4}']
    s = load(["--config", str(cfg), *flag], environ=env)
    assert s.trainer_config().ppo_n_minibatches == 4
    assert s.trainer_config().eps == 1e-6  # the trainer map still applies
    cfg.write_text("learner: {device: cpu, checkpoint_every: 2, checkpoint: {every_n_steps: 4}}\n")
    with pytest.raises(ValueError, match="checkpoint_every and checkpoint.every_n_steps"):
        load(["--config", str(cfg)], environ={})


def test_settings_read_pep604_optionals_from_env_and_yaml(tmp_path):
    """Settings annotations are ``X | None`` (pyupgrade): ``coerce`` must see them as optional."""
    from services.common.settings import coerce

    assert coerce("n", int | None, "7") == 7
    assert coerce("n", int | None, "none") is None
    assert coerce("xs", list[str] | None, "a,b") == ["a", "b"]
    with pytest.raises(ValueError, match="may not be empty"):
        coerce("n", int, None)
    s = LearnerSettings(device="cpu", auth_token_file=None, max_lag=None)
    assert s.auth_token_file is None and s.max_lag is None


async def test_learner_health_follows_progress_not_the_event_loop() -> None:
    import time
    from types import SimpleNamespace

    from services.learner.worker import Learner

    now = time.monotonic()
    fake = SimpleNamespace(
        started_at=now - 100,
        s=SimpleNamespace(health_stall_s=30.0),
        trainer=SimpleNamespace(last_progress=now - 50),
        source=SimpleNamespace(last_read=now - 5),
    )
    assert await Learner.health(fake)  # waiting for items: read 5 s ago
    fake.source.last_read = now - 40
    assert not await Learner.health(fake)  # nothing for 40 s > 30 s: a hung step or collective
    fake.trainer.last_progress = now - 1  # a step started a second ago
    assert await Learner.health(fake)


def test_lora_publish_adapter_needs_lora_and_the_http_plane():
    with pytest.raises(ValueError, match="set lora_rank, or use merged"):
        LearnerSettings(lora_publish="adapter")
    with pytest.raises(ValueError, match="lora_publish=adapter sends the adapters over the http"):
        LearnerSettings(lora_rank=4, lora_publish="adapter", publish_plane="collective")
    with pytest.raises(ValueError, match=r"lora_publish='both' must be one of"):
        LearnerSettings(lora_rank=4, lora_publish="both")
    s = LearnerSettings(lora_rank=4, lora_publish="adapter")
    assert s.trainer_config().lora_publish == "adapter"
