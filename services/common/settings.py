"""Settings dataclasses loadable from flags, ``LUDIC_*`` environment and a YAML file.

Precedence (later wins): dataclass defaults < YAML file < environment < command-line flags.

* YAML: ``--config PATH`` or ``LUDIC_CONFIG``. Keys of the service's own section
  (``actor:``, ``credit:``, ...) apply; top-level keys that name a field apply too (so one
  file can hold shared ``redis_url`` / ``run_id``). An unknown key in the service's
  section is an error naming the key.
* Environment: field ``foo_bar`` reads ``LUDIC_FOO_BAR``.
* Flags: ``--foo-bar VALUE`` (booleans: ``--foo-bar`` / ``--no-foo-bar``).

Lists come from YAML lists or comma-separated strings; dicts from YAML maps or JSON.
``--help`` shows every field's default and environment variable. Field metadata
(``field(metadata={...})``): ``help`` (its help text); ``flags`` (more spellings of its flag,
e.g. ``("--model",)``); ``repeat`` (the flag may be given several times, one list item each);
``words`` (a list given as one string splits on whitespace, as on a command line, not on
commas); ``env_only`` (a secret, read from its ``LUDIC_*`` variable only: no flag, as a
command line is visible to every user, and a YAML key naming it, as a file may be committed,
is an error whose text is this value, where to set it). A class attribute ``RETIRED_ENV``
({variable: what replaces it}) makes a start with a variable the service no longer reads an
error naming the fix.

The algorithm is configured once, in the top-level ``algorithm:`` section
(``{name, group_size, kwargs}`` and the optimisation options the learner reads,
libludic.training.algorithm_spec.AlgorithmSpec), read by feeder (group_size), credit and learner
through their ``algorithm`` field (env ``LUDIC_ALGORITHM`` as JSON). A per-service copy (``credit.algorithm``, ``learner.algorithm_kwargs``,
``feeder.group_size``, ...) is an error naming the fix, so the services cannot disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from libludic.staleness import DEFAULT_MAX_HEAD_OFFPOLICYNESS

if TYPE_CHECKING:
    from libludic.training.algorithm_spec import AlgorithmSpec

T = TypeVar("T")
ENV_PREFIX = "LUDIC_"
# credit pauses while the saw stream holds this many items; the learner's ack window must fit
SAW_HIGH_WATER = 4096
_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n", ""}
_SECRET_WORDS = ("token", "password", "secret", "api_key")


@dataclasses.dataclass
class RedisService:
    """The fields every Redis-backed service shares (actor, credit, eval, feeder, learner),
    declared once: each service's settings dataclass extends it."""

    redis_url: str = dataclasses.field(
        default="redis://127.0.0.1:6379/0", metadata={"help": "Redis URL"}
    )
    # the URL carries the password: from a file (a mounted Secret) it stays out of the
    # environment, argv and `docker inspect`
    redis_url_file: str | None = dataclasses.field(
        default=None, metadata={"help": "file holding the Redis URL (instead of redis_url)"}
    )
    run_id: str = dataclasses.field(
        default="default", metadata={"help": "run namespace of the Redis keys"}
    )
    log_level: str = dataclasses.field(default="INFO", metadata={"help": "logging level"})
    # where /metrics and /health listen: every address in a container or a pod (probes and
    # Prometheus come from outside), loopback under `ludic up` (nothing else needs them)
    metrics_host: str = dataclasses.field(
        default="0.0.0.0", metadata={"help": "address of the /metrics and /health server"}
    )


def secret(help_: str, where: str) -> Any:
    """A secret setting (default None): environment only, never shown (``env_only``: no
    flag, a YAML key naming it is an error whose text is ``where``, where to set it)."""
    return dataclasses.field(default=None, repr=False, metadata={"help": help_, "env_only": where})


#: where the weight endpoints' bearer token comes from (inference, learner)
AUTH_TOKEN_WHERE = (
    "set LUDIC_AUTH_TOKEN, or name a file holding it with auth_token_file (--auth-token-file)"
)


def secret_from_file(value: str | None, path: str | None, env: str, what: str) -> str | None:
    """A secret given in the environment variable ``env`` (``value``) or in the file ``path``
    names (a mounted Secret; surrounding whitespace dropped); both given must agree. Raises
    ``ValueError`` naming the file when it cannot be read, is empty or disagrees."""
    if not path:
        return value
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read {what} file {path!r}: {e.strerror}") from e
    if not token:
        raise ValueError(f"{what} file {path!r} is empty")
    if value and value != token:
        raise ValueError(
            f"{env} and the file {path!r} both give a value, and they differ: keep one"
        )
    return token


def _is_secret(name: str) -> bool:
    """A setting named like a secret (``auth_token``, ``api_key``; not ``micro_token_budget``)."""
    name = name.lower()
    if name.endswith("_budget"):
        return False
    return any(w in name.split("_") or name.endswith(w) for w in _SECRET_WORDS)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional?) of a field annotation."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:  # Optional[X] or X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def coerce(name: str, tp: Any, value: Any) -> Any:
    """Convert a YAML/env/flag value to the field's type; errors name the field."""
    base, optional = _base_type(tp)
    if value is None or (
        optional and isinstance(value, str) and value.strip().lower() in ("", "none", "null")
    ):
        if optional:
            return None
        raise ValueError(f"setting {name!r} may not be empty")
    origin = typing.get_origin(base) or base
    try:
        if origin is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            raise ValueError(f"expected a boolean (true/false), got {value!r}")
        if origin in (list, list, Sequence, tuple):
            args = typing.get_args(base)
            item_tp = args[0] if args else str
            if isinstance(value, str):
                s = value.strip()
                items: list[Any] = (
                    json.loads(s) if s.startswith("[") else [v for v in s.split(",") if v.strip()]
                )
            else:
                items = list(value)
            return [coerce(name, item_tp, v.strip() if isinstance(v, str) else v) for v in items]
        if origin in (dict, dict, Mapping):
            if isinstance(value, str):
                value = json.loads(value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ValueError(f"expected a mapping, got {type(value).__name__}")
            return dict(value)
        if origin is int:
            if isinstance(value, bool):
                raise ValueError("expected an integer, got a boolean")
            return int(value)
        if origin is float:
            return float(value)
        if origin is str:
            return str(value)
        if origin is Any:
            return value
    except (TypeError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"setting {name!r}: cannot read {value!r} as {tp}: {e}") from e
    return value


def _default_text(f: dataclasses.Field[Any]) -> str:
    """A field's default as ``--help`` shows it (secrets masked, argparse's % escaped)."""
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value and _is_secret(f.name):
        return "***"
    return json.dumps(value, default=str).replace("%", "%%")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    service: str,
    description: str = "",
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` (a dataclass) from defaults, YAML, ``LUDIC_*`` env and ``argv``.

    The YAML file is read here, once. ``cls.FROM_SECTIONS`` (optional) maps a field to the
    (section, key) of another service's section that supplies it when the service's own
    section and the top level do not (the eval service's ``n`` from ``up.eval_n``, the
    learner's ``saw_high_water`` from ``credit.saw_high_water``); env and flags still win."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    env_only = [f for f in fields if "env_only" in f.metadata]
    epilog = "environment only (never a flag or a YAML key): " + "; ".join(
        f"{ENV_PREFIX}{f.name.upper()}: {f.metadata.get('help', '')} [default {_default_text(f)}]"
        for f in env_only
    )
    parser = argparse.ArgumentParser(
        prog=f"ludic {service}",
        description=description,
        epilog=epilog if env_only else None,
        allow_abbrev=False,  # a misspelt flag is an error, never another flag's prefix
    )
    parser.add_argument("--config", default=None, help="YAML file (default: $LUDIC_CONFIG)")
    for f in fields:
        if f in env_only:
            continue
        help_ = f.metadata.get("help", "")
        env_name = ENV_PREFIX + f.name.upper()
        base, _ = _base_type(hints[f.name])
        shown = f"default {_default_text(f)}; env {env_name}"
        flags = [_flag(f.name), *f.metadata.get("flags", ())]
        if base is bool:
            parser.add_argument(
                *flags,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_} [{shown}]",
            )
        elif f.metadata.get("repeat"):
            parser.add_argument(
                *flags, dest=f.name, action="append", default=None, help=f"{help_} [{shown}]"
            )
        else:
            parser.add_argument(*flags, dest=f.name, default=None, help=f"{help_} [{shown}]")
    args = parser.parse_args(list(argv or []))

    values: dict[str, Any] = {}
    origin: dict[str, int] = {}  # field -> _YAML | _ENV | _FLAG, where its value came from
    cfg_path = args.config or env.get(ENV_PREFIX + "CONFIG")
    names = {f.name for f in fields}
    if "algorithm" in names:
        for var, key in _RETIRED_ENV.items():
            if var in env:
                raise ValueError(
                    f"{var}={env[var]!r} is no longer read: move it to the top-level algorithm: "
                    f"section as algorithm.{key} (or LUDIC_ALGORITHM='{{\"{key}\": ...}}' as JSON)"
                )
    for var, fix in getattr(cls, "RETIRED_ENV", {}).items():
        if var in env:
            raise ValueError(f"{var} is set but no longer read: {fix}")
    if cfg_path:
        doc = read_yaml(cfg_path)
        values.update(read_yaml_section(doc, cfg_path, service, names))
        for name, (section, key) in getattr(cls, "FROM_SECTIONS", {}).items():
            other = doc.get(section)
            if name not in values and isinstance(other, Mapping) and key in other:
                values[name] = other[key]
        origin.update(dict.fromkeys(values, _YAML))
        for f in env_only:
            if f.name in values:
                raise ValueError(
                    f"config file {cfg_path}: {f.name} is a secret and is never read from a "
                    f"config file: {f.metadata['env_only']}"
                )
    for f in fields:
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            values[f.name] = raw
            origin[f.name] = _ENV
    for f in fields:
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
            origin[f.name] = _FLAG
    if "config_path" in names and cfg_path and "config_path" not in values:
        values["config_path"] = cfg_path
    words = {f.name for f in fields if f.metadata.get("words")}
    out = {
        k: coerce(k, hints[k], v.split() if k in words and isinstance(v, str) else v)
        for k, v in values.items()
    }
    _resolve_nested(cls, out, origin)
    if out.get("redis_url_file"):
        out["redis_url"] = secret_from_file(
            out.get("redis_url"), out["redis_url_file"], "LUDIC_REDIS_URL", "redis_url"
        )
    return cls(**out)


_YAML, _ENV, _FLAG = 1, 2, 3
_ORIGIN_NAME = {_YAML: "the YAML", _ENV: "the environment", _FLAG: "a flag"}


def _resolve_nested(cls: type, out: dict[str, Any], origin: Mapping[str, int]) -> None:
    """One precedence for settings reachable two ways. ``cls.NESTED`` maps a mapping field
    (the learner's ``checkpoint``, CheckpointConfig's names) to {its key: the flat field that
    sets the same thing} (``every_n_steps: checkpoint_every``). A key
    and its flat field both set: the one from the higher source (flags > env > YAML) wins
    (the key is dropped here when the flat field's source is higher; the mapping's value
    beats the flat one where the settings derive their config); both from the same source
    is an error naming them."""
    for nested, aliases in getattr(cls, "NESTED", {}).items():
        mapping = out.get(nested)
        if not isinstance(mapping, Mapping):
            continue
        mapping = dict(mapping)
        for key, flat in aliases.items():
            if key not in mapping or flat not in origin:
                continue
            if origin[flat] == origin[nested]:
                raise ValueError(
                    f"{flat} and {nested}.{key} are both set in {_ORIGIN_NAME[origin[flat]]}; "
                    "they name the same setting: keep one"
                )
            if origin[flat] > origin[nested]:
                del mapping[key]  # the flat value, from a higher source, applies
        out[nested] = mapping


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"config file {p} does not exist (from --config / LUDIC_CONFIG)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping at the top level")
    return data


# keys that belong to the top-level algorithm: section only
ALGORITHM_KEYS = ("algorithm", "algorithm_kwargs", "group_size")
_RETIRED_ENV = {"LUDIC_GROUP_SIZE": "group_size", "LUDIC_ALGORITHM_KWARGS": "kwargs"}


def check_algorithm_section(data: Mapping[str, Any], path: str | Path) -> None:
    """Errors for algorithm settings outside the top-level ``algorithm:`` section."""
    algo = data.get("algorithm")
    if algo is not None and not isinstance(algo, dict):
        raise ValueError(
            f"config file {path}: algorithm: must be a mapping like {{name: grpo, group_size: 8, "
            f"kwargs: {{}}}}, got {algo!r}"
        )
    for k in ("algorithm_kwargs", "group_size"):
        if k in data:
            raise ValueError(
                f"config file {path}: top-level {k!r}: move it to the top-level algorithm: "
                f"section as algorithm.{'kwargs' if k == 'algorithm_kwargs' else k}"
            )
    for section, body in data.items():
        if not isinstance(body, dict) or section == "algorithm":
            continue
        for k in ALGORITHM_KEYS:
            if k in body:
                target = {
                    "algorithm": "algorithm.name",
                    "algorithm_kwargs": "algorithm.kwargs",
                }.get(k, f"algorithm.{k}")
                raise ValueError(
                    f"config file {path}: {section}.{k} is a per-service copy of the algorithm; "
                    f"move {section}.{k} to the top-level algorithm: section as {target} "
                    "(algorithm: {name: grpo, group_size: 8, kwargs: {}}), read by feeder, credit "
                    "and learner alike"
                )


def check_staleness_keys(data: Mapping[str, Any], path: str | Path) -> None:
    """The two staleness bounds (libludic/staleness.py), one name and one place each:
    ``max_head_offpolicyness`` (admission) at the top level, read by feeder and actors;
    ``max_lag`` (the drop bound) in ``learner:`` only. An admission bound above the drop
    bound generates samples only to drop them: an error naming both."""
    for section, body in data.items():
        if not isinstance(body, dict):
            continue
        if "max_head_offpolicyness" in body:
            raise ValueError(
                f"config file {path}: {section}.max_head_offpolicyness: move it to the top "
                "level (max_head_offpolicyness: N), read by feeder and actors alike"
            )
        if section in ("actor", "feeder") and "max_lag" in body:
            raise ValueError(
                f"config file {path}: {section}.max_lag: the admission bound is the top-level "
                "max_head_offpolicyness (max_lag is the learner's drop bound, learner.max_lag)"
            )
    head = data.get("max_head_offpolicyness", DEFAULT_MAX_HEAD_OFFPOLICYNESS)
    lag = (
        (data.get("learner") or {}).get("max_lag")
        if isinstance(data.get("learner"), dict)
        else None
    )
    if (
        head is not None
        and lag is not None
        and isinstance(head, int)
        and isinstance(lag, int)
        and lag < head
    ):
        raise ValueError(
            f"config file {path}: learner.max_lag={lag} < max_head_offpolicyness={head}: "
            f"samples admitted {head} versions ahead would be dropped as stale; raise "
            "learner.max_lag or lower max_head_offpolicyness"
        )


def check_tracker_section(data: Mapping[str, Any], path: str | Path) -> None:
    """The experiment trackers are the top-level ``tracker:`` section, in one place (read by
    the learner, services/learner/tracker.py): a service's copy, or AReaL's ``stats_logger``,
    is an error saying where to move it."""
    if "stats_logger" in data:
        raise ValueError(
            f"config file {path}: AReaL's stats_logger is the top-level tracker: section here "
            "(tracker: {wandb: {...}, swanlab: {...}, tensorboard: {path}}); rename it"
        )
    for section, body in data.items():
        if isinstance(body, dict) and "tracker" in body:
            raise ValueError(
                f"config file {path}: {section}.tracker: move it to the top-level tracker: "
                "section (read by the learner)"
            )


def check_ack_window(checkpoint_every: int, batch_size: int, saw_high_water: int) -> None:
    """The learner's checkpoint window against credit's backpressure. With checkpoints on,
    the learner acks items only at a checkpoint: up to ``checkpoint_every * batch_size``
    trained items stay in the saw stream. Credit pauses while the stream holds
    ``saw_high_water`` items, so a larger window never fills: the learner waits for items
    credit will not write. Refuse that run config (the learner checks it with its resolved
    settings, credit's ``saw_high_water`` read from the ``credit:`` section)."""
    held = checkpoint_every * batch_size
    if saw_high_water > 0 and held > saw_high_water:
        raise ValueError(
            f"learner checkpoint_every={checkpoint_every} x batch_size={batch_size} = {held} items "
            f"stay un-acked between checkpoints, more than credit.saw_high_water={saw_high_water} "
            "(credit stops writing at that backlog, so the run would stall); lower "
            "checkpoint_every or raise credit.saw_high_water"
        )


def check_service_algorithm(spec: AlgorithmSpec, service: str) -> None:
    """Refuse, where credit and learner read the ``algorithm:`` section, an algorithm the
    services do not carry yet: PPO with a critic (``ppo``: the advantages are the learner's,
    GAE over a value model it trains) is the library's alone for now."""
    if spec.build().needs_critic:
        raise ValueError(
            f"{service}: algorithm.name={spec.name!r} trains a critic (PPO with GAE), which the "
            "services do not carry yet (the learner has no critic_lr setting, and its batches "
            "and ranks may split a multi-step rollout that GAE must see whole); train it in "
            "one process with libludic's Trainer (RolloutBatchSource), or choose a "
            "critic-free algorithm for ludic up (grpo, dr_grpo, cispo, gspo, sapo, dapo, "
            "scalerl, reinforce)"
        )


def algorithm_group_size(algorithm: Mapping[str, Any]) -> int:
    """``algorithm.group_size`` (default 8) without building the algorithm (the feeder's
    episodes per request; credit and learner validate the whole section)."""
    if not isinstance(algorithm, Mapping):
        raise ValueError(
            f"algorithm must be a mapping {{name, group_size, kwargs}}, got {algorithm!r}"
        )
    g = algorithm.get("group_size", 8)
    try:
        if isinstance(g, bool):
            raise ValueError
        n = int(g)
    except (TypeError, ValueError):
        raise ValueError(f"algorithm.group_size={g!r} must be an integer >= 1") from None
    if n < 1:
        raise ValueError(f"algorithm.group_size={g!r} must be an integer >= 1")
    return n


def read_yaml_section(
    data: dict[str, Any], path: str | Path, service: str, names: set
) -> dict[str, Any]:
    """The values of ``service``'s fields ``names`` in the run config ``data`` (read from
    ``path``): top-level keys, then the service's own section over them."""
    check_algorithm_section(data, path)
    check_staleness_keys(data, path)
    check_tracker_section(data, path)
    out = {k: v for k, v in data.items() if k in names}
    section = data.get(service)
    if section is not None:
        if not isinstance(section, dict):
            raise ValueError(f"config file {path}: section {service!r} must be a mapping")
        unknown = sorted(set(section) - names)
        if unknown:
            raise ValueError(
                f"config file {path}: unknown key(s) {unknown} in section {service!r}; "
                f"known: {sorted(names)}"
            )
        out.update(section)
    return out


_URL_CREDENTIALS = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*:)[^/@\s]+@")


def redact_url(text: str) -> str:
    """``redis://:pw@host`` -> ``redis://:***@host``: the password of every URL in ``text``."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group('head')}***@", text)


def redact_values(v: Any) -> Any:
    """``v`` with the password of every URL in its strings masked, at any depth."""
    if isinstance(v, str):
        return redact_url(v)
    if isinstance(v, dict):
        return {k: redact_values(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [redact_values(x) for x in v]
    return v


def redacted(settings: Any) -> dict[str, Any]:
    """The settings as a dict with secrets masked: fields named like a secret (token,
    password, secret, api_key) and the password of every URL (a Redis URL carries one)."""
    d = dataclasses.asdict(settings)
    for k in list(d):
        if d[k] and _is_secret(k):
            d[k] = "***"
        else:
            d[k] = redact_values(d[k])
    return d


def log_settings(log: logging.Logger, service: str, settings: Any) -> None:
    """Log the whole resolved config once at start-up (secrets redacted)."""
    log.info(
        "ludic %s config: %s", service, json.dumps(redacted(settings), sort_keys=True, default=str)
    )


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
