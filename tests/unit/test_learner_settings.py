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


def test_trainer_section_accepts_the_specs_learning_rate_alias():
    s = LearnerSettings(device="cpu", trainer={"learning_rate": 3e-4})
    assert s.trainer_config().lr == 3e-4
    assert LearnerSettings(device="cpu", trainer={"lr": 2e-4}).trainer_config().lr == 2e-4
    with pytest.raises(ValueError, match="both lr and learning_rate"):
        LearnerSettings(device="cpu", trainer={"lr": 1e-4, "learning_rate": 3e-4}).trainer_config()
    with pytest.raises(ValueError, match=r"unknown TrainerConfig key\(s\) \['learnig_rate'\]"):
        LearnerSettings(device="cpu", trainer={"learnig_rate": 3e-4}).trainer_config()


def test_the_lr_schedule_spans_the_learners_num_steps():
    s = LearnerSettings(
        device="cpu",
        num_steps=40,
        trainer={"lr_scheduler_type": "cosine", "warmup_steps_proportion": 0.1},
    )
    cfg = s.trainer_config()
    assert cfg.total_steps == 40
    # W = int(0.1 * 40) = 4 warmup steps at 1/4 .. 4/4 of lr, then the cosine from lr to 0
    assert cfg.lr_at(0) == s.lr / 4 and cfg.lr_at(4) == s.lr and cfg.lr_at(40) == 0.0
    with pytest.raises(ValueError, match="decays over a horizon"):  # num_steps 0: until stopped
        LearnerSettings(device="cpu", trainer={"lr_scheduler_type": "linear"}).trainer_config()


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


def test_a_flag_beats_the_yaml_trainer_map_and_one_source_may_not_say_it_twice(tmp_path):
    from services.learner.settings import load

    cfg = tmp_path / "run.yaml"
    cfg.write_text("learner: {device: cpu, trainer: {lr: 2.0e-4, max_seq_len: 64}}\n")
    assert load(["--config", str(cfg)]).trainer_config().lr == 2e-4  # the map, alone
    s = load(["--config", str(cfg), "--lr", "5e-5"])
    assert s.trainer_config().lr == 5e-5  # flags > YAML, whichever form the YAML used
    assert s.trainer_config().max_seq_len == 64  # the map's other keys still apply
    assert s.trainer == {"max_seq_len": 64}
    # the map from a higher source than the flat field: the map
    s = load(["--config", str(cfg), "--trainer", '{"lr": 7e-5}'])
    assert s.trainer_config().lr == 7e-5
    cfg.write_text("learner: {device: cpu, lr: 1.0e-4, trainer: {learning_rate: 2.0e-4}}\n")
    with pytest.raises(ValueError, match=r"lr and trainer.learning_rate are both set in the YAML"):
        load(["--config", str(cfg)])
    cfg.write_text("learner: {device: cpu, checkpoint_every: 2, checkpoint: {every_n_steps: 4}}\n")
    with pytest.raises(ValueError, match="checkpoint_every and checkpoint.every_n_steps"):
        load(["--config", str(cfg)])


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
