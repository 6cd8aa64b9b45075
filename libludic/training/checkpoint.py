"""Checkpoints: atomic, self-validating directories of safetensors + JSON (no pickle).

Layout of ``{output_dir}/step_{step:09d}/``::

    model.safetensors       full model state dict (HF names; tied weights stored twice)
    optimizer.safetensors   optimizer tensors, keys ``state::{param_fqn}::{name}``
    {part}.safetensors      the same two for each further trained module, ``parts`` (a
    {part}_optimizer...     Trainer's critic: ``critic``), beside the policy's
    rng.safetensors         torch CPU (and CUDA) generator states
    manifest.json           step, file sizes, optimizer scalars/param_groups (the parts'
                            under ``parts``), python and numpy RNG states, the caller's
                            ``extra`` dict
    COMPLETE                written last

A checkpoint is written into a hidden temp directory and renamed into place, so a crash
leaves either the previous set or a complete new one. On load, a directory without
COMPLETE, with an unreadable manifest or with a file whose size differs from the manifest is
*torn*: it is skipped with a warning and the next newest valid one is used.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from libludic.training import parallel
from libludic.training.critic import Critic
from libludic.training.publishing import VersionedPublisher
from libludic.training.throughput import Throughput
from libludic.training.types import BatchSource, CheckpointedBatchSource

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass
class CheckpointConfig:
    output_dir: str
    every_n_steps: int = 0  # 0 = never save automatically
    max_to_keep: int | None = 2  # None = keep all
    save_optimizer: bool = True

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("CheckpointConfig.output_dir must be a directory path")
        if self.every_n_steps < 0:
            raise ValueError(f"CheckpointConfig.every_n_steps={self.every_n_steps} must be >= 0")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(
                f"CheckpointConfig.max_to_keep={self.max_to_keep} must be >= 1 or None (keep all)"
            )


@dataclass
class LoadedCheckpoint:
    step: int
    path: Path
    model_state: dict[str, Any]  # torch.distributed.checkpoint's: tensors, by name
    optimizer_state: dict[str, Any] | None
    rng_state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    # further trained modules (a critic) by name: (model state, optimizer state or None)
    parts: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = field(default_factory=dict)


# ---------------------------------------------------------------- RNG state


def full_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's whole state on the host, unsharded (collective under
    FSDP2: every rank calls it), as ``CheckpointManager.save`` takes them."""
    # torch.distributed.checkpoint takes ~0.6 s to import: only a learner with checkpoints
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    return msd, osd


def restore_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ck: LoadedCheckpoint,
    from_rank0: bool = False,
    part: str | None = None,
) -> None:
    """Load ``ck``'s model and optimizer state (or those of its part ``part``) into
    ``model`` and ``optimizer`` (sharded or not; collective under FSDP2). ``from_rank0``:
    only rank 0's ``ck`` holds the tensors (the others' come from ``share_checkpoint``),
    broadcast one at a time into every rank's shards."""
    # see full_training_state: a heavy import, for a resume only
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    msd, osd = (ck.model_state, ck.optimizer_state) if part is None else ck.parts[part]
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
    set_model_state_dict(model, msd, options=opts)
    if osd is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=opts)


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensor part, JSON part) of the torch / CUDA / python / numpy generator states."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda::{i}"] = s
    ver, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    js = {
        "python": [ver, list(state), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    return tensors, js


def restore_rng_state(tensors: Mapping[str, torch.Tensor], js: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = sorted((k for k in tensors if k.startswith("cuda::")), key=lambda k: int(k[6:]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    ver, state, gauss = js["python"]
    random.setstate((ver, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def share_checkpoint(ck: LoadedCheckpoint | None, device: torch.device) -> LoadedCheckpoint | None:
    """Rank 0's ``ck`` (loaded from its disk) on every rank, without the tensors: None
    everywhere when rank 0 has none; else the step, path, ``extra`` and RNG states, which the
    other ranks restore as rank 0 did, and empty model and optimizer states for
    ``restore_training_state(..., from_rank0=True)`` to fill. Collective (JSON broadcast):
    the checkpoint files need only be where rank 0 runs."""
    head = None
    if parallel.rank() == 0 and ck is not None:
        head = {
            "step": ck.step,
            "path": str(ck.path),
            "extra": ck.extra,
            "optimizer": ck.optimizer_state is not None,
            "parts": {name: osd is not None for name, (_, osd) in ck.parts.items()},
            "rng_json": ck.rng_state["json"],
            "rng": {k: t.numpy().tobytes().hex() for k, t in ck.rng_state["tensors"].items()},
        }
    head = parallel.broadcast_json(head, device)
    if head is None or parallel.rank() == 0:
        return ck
    rng = {
        k: torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8) for k, h in head["rng"].items()
    }
    restore_rng_state(rng, head["rng_json"])
    return LoadedCheckpoint(
        step=int(head["step"]),
        path=Path(head["path"]),
        model_state={},
        optimizer_state={} if head["optimizer"] else None,
        rng_state={"tensors": rng, "json": head["rng_json"]},
        extra=dict(head["extra"]),
        parts={name: ({}, {} if opt else None) for name, opt in head["parts"].items()},
    )


# ---------------------------------------------------------------- optimizer state


def _flatten_optimizer(osd: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into safetensors-able tensors and JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state::{pid}::{k}"] = v.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[k] = v
    groups = []
    for g in osd["param_groups"]:
        gg = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            gg[k] = list(v) if isinstance(v, tuple) else v
        groups.append(gg)
    # state keys are FQN strings (DCP state dicts) or ints (plain optimizer.state_dict())
    key_kind = "int" if any(isinstance(p, int) for p in osd["state"]) else "str"
    return tensors, {"scalars": scalars, "param_groups": groups, "key_kind": key_kind}


def _unflatten_optimizer(
    tensors: Mapping[str, torch.Tensor], js: Mapping[str, Any]
) -> dict[str, Any]:
    conv = int if js.get("key_kind") == "int" else str
    state: dict[Any, dict[str, Any]] = {}
    for key, t in tensors.items():
        _, pid, name = key.split("::", 2)
        state.setdefault(conv(pid), {})[name] = t
    for pid, sc in js["scalars"].items():
        state.setdefault(conv(pid), {}).update(sc)
    groups = []
    for g in js["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        if js.get("key_kind") == "int":
            g["params"] = [int(p) for p in g["params"]]
        groups.append(g)
    return {"state": state, "param_groups": groups}


def _dedup_storage(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage (tied embeddings): copy repeated tensors."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        t = v.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[k] = t
    return out


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- manager


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig) -> None:
        self.cfg = cfg
        self.root = Path(cfg.output_dir)

    def should_save(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step > 0 and step % self.cfg.every_n_steps == 0

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:09d}"

    def save(
        self,
        step: int,
        model_state: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        parts: Mapping[str, tuple[Mapping[str, torch.Tensor], Mapping[str, Any] | None]]
        | None = None,
    ) -> Path:
        """Write checkpoint ``step`` atomically (RNG states captured here) and prune old ones.
        ``parts``: further trained modules by name (module docstring), each (model state,
        optimizer state or None)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step_{step:09d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files: dict[str, int] = {}
            save_file(_dedup_storage(model_state), str(tmp / "model.safetensors"))
            files["model.safetensors"] = 0
            opt_js: dict[str, Any] | None = None
            if optimizer_state is not None and self.cfg.save_optimizer:
                ot, opt_js = _flatten_optimizer(optimizer_state)
                save_file(ot, str(tmp / "optimizer.safetensors"))
                files["optimizer.safetensors"] = 0
            parts_js: dict[str, dict[str, Any] | None] = {}
            for name, (p_model, p_opt) in (parts or {}).items():
                if name in ("model", "optimizer", "rng") or not name.isidentifier():
                    raise ValueError(f"checkpoint part {name!r}: use a plain name of its own")
                save_file(_dedup_storage(p_model), str(tmp / f"{name}.safetensors"))
                files[f"{name}.safetensors"] = 0
                parts_js[name] = None
                if p_opt is not None and self.cfg.save_optimizer:
                    pt, parts_js[name] = _flatten_optimizer(p_opt)
                    save_file(pt, str(tmp / f"{name}_optimizer.safetensors"))
                    files[f"{name}_optimizer.safetensors"] = 0
            rng_t, rng_js = capture_rng_state()
            save_file(rng_t, str(tmp / "rng.safetensors"))
            files["rng.safetensors"] = 0
            for name in files:
                files[name] = (tmp / name).stat().st_size
            manifest = {
                "format_version": FORMAT_VERSION,
                "step": int(step),
                "files": files,
                "optimizer": opt_js,
                "parts": parts_js,
                "rng": rng_js,
                "extra": dict(extra or {}),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            for name in list(files) + [MANIFEST]:
                with open(tmp / name, "rb") as f:
                    os.fsync(f.fileno())
            (tmp / COMPLETE).write_text(str(step))
            _fsync_dir(tmp)
            final = self.step_dir(step)
            if final.exists():  # re-saving a step: move the old one out of the way first
                old = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def validate(self, path: Path) -> str | None:
        """None if ``path`` is a complete checkpoint, else why it is torn."""
        if not (path / COMPLETE).exists():
            return f"no {COMPLETE} marker"
        try:
            m = json.loads((path / MANIFEST).read_text())
            files = m["files"]
            int(m["step"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"bad {MANIFEST} ({e})"
        for name, size in files.items():
            p = path / name
            if not p.exists():
                return f"missing {name}"
            if p.stat().st_size != size:
                return f"{name} has {p.stat().st_size} bytes, manifest says {size}"
        return None

    def list_checkpoints(self) -> list[Path]:
        """Valid checkpoints, oldest first; torn ones are skipped with a warning."""
        if not self.root.exists():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if not m or not p.is_dir():
                continue
            why = self.validate(p)
            if why is not None:
                log.warning("skipping torn checkpoint %s: %s", p, why)
                continue
            found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        cps = self.list_checkpoints()
        return cps[-1] if cps else None

    def load(self, path: Path | None = None, restore_rng: bool = True) -> LoadedCheckpoint | None:
        """Load ``path`` (default: newest valid). Restores the RNG states unless told not to."""
        if path is None:
            path = self.latest()
            if path is None:
                return None
        else:
            why = self.validate(Path(path))
            if why is not None:
                raise ValueError(f"checkpoint {path} is torn ({why}); pick another or load latest")
        path = Path(path)
        m = json.loads((path / MANIFEST).read_text())
        model_state = load_file(str(path / "model.safetensors"))
        opt = None
        if m.get("optimizer") is not None and (path / "optimizer.safetensors").exists():
            opt = _unflatten_optimizer(
                load_file(str(path / "optimizer.safetensors")), m["optimizer"]
            )
        parts: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {}
        for name, p_js in (m.get("parts") or {}).items():
            p_opt = None
            if p_js is not None:
                p_opt = _unflatten_optimizer(
                    load_file(str(path / f"{name}_optimizer.safetensors")), p_js
                )
            parts[name] = (load_file(str(path / f"{name}.safetensors")), p_opt)
        rng_t = load_file(str(path / "rng.safetensors"))
        if restore_rng:
            restore_rng_state(rng_t, m["rng"])
        return LoadedCheckpoint(
            step=int(m["step"]),
            path=path,
            model_state=model_state,
            optimizer_state=opt,
            rng_state={"tensors": rng_t, "json": m["rng"]},
            extra=dict(m.get("extra") or {}),
            parts=parts,
        )

    def _prune(self) -> None:
        if self.cfg.max_to_keep is None:
            return
        cps = self.list_checkpoints()
        for p in cps[: max(0, len(cps) - self.cfg.max_to_keep)]:
            shutil.rmtree(p, ignore_errors=True)


class Resumable(Protocol):
    """What a checkpoint saves of a training loop and restores into it (the Trainer)."""

    step: int
    last_checkpoint_step: int

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def publishing(self) -> VersionedPublisher: ...
    @property
    def throughput(self) -> Throughput: ...
    @property
    def batch_source(self) -> BatchSource: ...
    @property
    def distributed(self) -> bool: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def policy_version(self) -> int: ...
    @property
    def critic(self) -> Critic | None: ...


def save_trainer(
    tr: Resumable, checkpointer: CheckpointManager, extra: dict[str, Any] | None = None
) -> Path | None:
    """Save ``tr``'s model + optimizer (+ its critic's, part ``critic``: PPO) + RNG + step +
    policy_version + its throughput totals (a resumed Trainer's ``samples_per_s`` covers the
    steps before the resume) + its batch source's position + ``extra``. Collective under
    FSDP2; rank 0 writes and returns the path."""
    msd, osd = full_training_state(tr.model, tr.optimizer)  # collective under FSDP2
    parts = {}
    if tr.critic is not None:  # PPO's value model, beside the policy
        parts["critic"] = full_training_state(tr.critic.model, tr.critic.optimizer)
    if parallel.rank() != 0:
        return None
    ex: dict[str, Any] = {
        "trainer_step": tr.step,
        "policy_version": tr.policy_version,
        **tr.throughput.state(),
    }
    if isinstance(tr.batch_source, CheckpointedBatchSource):
        ex["batch_source"] = tr.batch_source.state_dict()
    ex.update(extra or {})
    return checkpointer.save(tr.step, msd, osd, extra=ex, parts=parts)


def load_trainer(
    tr: Resumable, checkpointer: CheckpointManager, path: Path | None = None
) -> LoadedCheckpoint | None:
    """Restore the newest valid checkpoint (or ``path``) into ``tr``; None if there is none.
    Under FSDP2 rank 0 reads it and every rank gets it from rank 0 (``share_checkpoint``,
    then the tensors broadcast into the shards): only rank 0 needs the files, and no other
    rank holds the whole model or optimizer state."""
    if tr.distributed:
        ck = checkpointer.load(path) if parallel.rank() == 0 else None
        ck = share_checkpoint(ck, tr.device)
    else:
        ck = checkpointer.load(path)
    if ck is None:
        return None
    if tr.critic is not None and "critic" not in ck.parts:
        raise ValueError(
            f"checkpoint {ck.path} holds no critic: it was saved by a Trainer that trained "
            "none (not ppo); resume ppo from a ppo checkpoint, or start its policy from this "
            "one's model.safetensors (a model path) with a fresh critic"
        )
    restore_training_state(tr.model, tr.optimizer, ck, from_rank0=tr.distributed)
    if tr.critic is not None:
        restore_training_state(
            tr.critic.model, tr.critic.optimizer, ck, from_rank0=tr.distributed, part="critic"
        )
    tr.step = int(ck.extra.get("trainer_step", ck.step))
    tr.last_checkpoint_step = tr.step
    tr.publishing.restore(int(ck.extra.get("policy_version", 0)))
    tr.throughput.restore(ck.extra)
    if "batch_source" in ck.extra and isinstance(tr.batch_source, CheckpointedBatchSource):
        tr.batch_source.load_state_dict(ck.extra["batch_source"])
    return ck
