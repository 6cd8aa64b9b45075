"""What a run config names by ``{kind, kwargs}``: the credit assigners and losses of a
``custom`` algorithm, built from plain data (a kind is a registered name or an import path,
libludic/plugins.py), and :func:`make_custom`, the preset that composes them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

from libludic import plugins
from libludic.plugins import PluginError
from libludic.registry import PluginRegistry
from libludic.training.algorithm import RLAlgorithm
from libludic.training.credit_assignment import CreditAssigner, NormalizedReturn
from libludic.training.kl import KLRewardPenalty
from libludic.training.loss import CompositeLoss, LossTerm, OffPolicyCorrection
from libludic.training.normalization import NormConfig
from libludic.training.preset_options import PresetOptions, RewardOptions

#: what a ``custom`` algorithm's ``credit`` may name: the entry-point group ``ludic.credit``
#: (the built-in assigners, registered under their class names) or an import path
CREDIT_ASSIGNERS = PluginRegistry("credit")
#: what a ``custom`` algorithm's ``loss`` may name (``ludic.losses``, or an import path);
#: ``CompositeLoss`` takes ``terms: [{name, coeff, loss: {kind, kwargs}}]``
LOSSES = PluginRegistry("losses")


def _options(what: str, key: str, cls: Any, spec: Any) -> Any:
    """A loss's ``key`` argument given as a mapping of the dataclass ``cls``'s fields (or as
    a ``cls``): ``off_policy`` (OffPolicyCorrection), ``kl_in_reward`` (KLRewardPenalty)."""
    if isinstance(spec, cls):
        return spec
    known = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(spec, Mapping):
        raise ValueError(f"{what}: {key} must be a mapping of {known}, got {spec!r}")
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown {key} key(s) {unknown}; known: {known}")
    try:
        return cls(**spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: {key}: {e}") from e


def build_component(what: str, spec: Any, registry: PluginRegistry, **defaults: Any) -> Any:
    """``registry[spec.kind](**spec.kwargs)`` with ``defaults`` for parameters it has and the
    spec leaves unset; a misspelt kind, key or keyword lists the known ones."""
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{what} must be a mapping {{kind, kwargs}}, got {spec!r}")
    unknown = sorted(set(spec) - {"kind", "kwargs"})
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; known: kind, kwargs")
    kind = spec.get("kind")
    cls = plugins.resolve(registry.group, kind, where=f"{what}.kind")
    kwargs = dict(spec.get("kwargs") or {})
    params, _ = plugins.parameters(cls)
    for k, v in defaults.items():
        if k in params and k not in kwargs:
            kwargs[k] = v
    # a missing one is the constructor's to name (CompositeLoss's terms: with their shape)
    plugins.check_kwargs(cls, kwargs, where=f"{what} {kind}", require=False)
    if "off_policy" in kwargs:
        kwargs["off_policy"] = _options(
            f"{what} {kind}", "off_policy", OffPolicyCorrection, kwargs["off_policy"]
        )
    if kwargs.get("kl_in_reward") is not None:  # a ratio loss's KL penalty on the reward
        kwargs["kl_in_reward"] = _options(
            f"{what} {kind}", "kl_in_reward", KLRewardPenalty, kwargs["kl_in_reward"]
        )
    for k in ("reward_norm", "adv_norm"):  # NormalizedReturn's NormConfig mappings
        if cls is NormalizedReturn and kwargs.get(k) is not None:
            kwargs[k] = NormConfig.parse(kwargs[k], k)
    if cls is CompositeLoss:
        terms = kwargs.get("terms")
        if not isinstance(terms, Sequence) or isinstance(terms, str) or not terms:
            raise ValueError(
                f"{what} CompositeLoss needs kwargs.terms: [{{name, coeff, loss: {{kind, "
                f"kwargs}}}}, ...], got {terms!r}"
            )
        built = []
        for i, t in enumerate(terms):
            if not isinstance(t, Mapping) or set(t) - {"name", "coeff", "loss"} or "loss" not in t:
                raise ValueError(
                    f"{what} CompositeLoss term {i}: a mapping {{name, coeff, loss}}, got {t!r}"
                )
            sub = build_component(f"{what}.terms[{i}].loss", t["loss"], registry)
            name = str(t.get("name") or f"term{i}")
            built.append(LossTerm(name=name, loss=sub, coeff=float(t.get("coeff", 1.0))))
        kwargs["terms"] = built
    try:
        return cls(**kwargs)
    except PluginError:
        raise
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} {kind}: {e}") from e


def make_custom(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    credit: Any = None,
    loss: Any = None,
    **options: Unpack[RewardOptions],
) -> RLAlgorithm:
    """A credit assigner and a loss named directly instead of a preset:
    ``credit: {kind, kwargs}`` (a :data:`CREDIT_ASSIGNERS` name) and ``loss: {kind,
    kwargs}`` (a :data:`LOSSES` name; a ``CompositeLoss`` sums named terms, each ``{name,
    coeff, loss: {kind, kwargs}}``; a loss's ``off_policy`` is a mapping of
    ``OffPolicyCorrection`` fields, a ratio loss's ``kl_in_reward`` one of
    ``KLRewardPenalty``'s, ``{coeff, estimator}``). A credit assigner with a ``group_size``
    gets the run's unless its kwargs set one; ``gamma`` (default None: the assigner's own
    default) is passed to the credit assigner, which must take it, and must agree with its
    kwargs. The reward options are the presets'. For example::

        algorithm:
          name: custom
          group_size: 8
          kwargs:
            credit: {kind: GroupNormalizedReturn, kwargs: {normalize_adv: true}}
            loss:
              kind: CompositeLoss
              kwargs:
                terms:
                  - {name: pg, loss: {kind: TokenClippedSurrogateLoss, kwargs: {eps_clip: 0.2}}}
                  - {name: kl, coeff: 0.01, loss: {kind: TokenKLLoss}}
    """
    o = PresetOptions.parse("custom", options, RewardOptions)
    if credit is None or loss is None:
        raise ValueError(
            "algorithm custom needs kwargs.credit and kwargs.loss, each {kind, kwargs}: "
            f"credit one of {sorted(CREDIT_ASSIGNERS)}, loss one of {sorted(LOSSES)}"
        )
    return RLAlgorithm(
        name="custom",
        credit_assigner=_custom_credit(credit, group_size, gamma),
        loss=build_component("algorithm.kwargs.loss", loss, LOSSES),
        **o.reward(),
    )


def _custom_credit(credit: Any, group_size: int, gamma: float | None) -> CreditAssigner:
    """``credit`` built with the run's ``group_size`` and ``gamma`` (when set) as defaults;
    ``gamma`` set for an assigner that takes none, or set twice to different values, is an
    error naming the fix."""
    given = (credit.get("kwargs") or {}) if isinstance(credit, Mapping) else {}
    if gamma is not None and isinstance(given, Mapping) and given.get("gamma", gamma) != gamma:
        raise ValueError(
            f"algorithm.kwargs.gamma={gamma!r} and algorithm.kwargs.credit.kwargs.gamma="
            f"{given['gamma']!r} differ; give it once"
        )
    extra = {} if gamma is None else {"gamma": gamma}
    assigner = build_component(
        "algorithm.kwargs.credit", credit, CREDIT_ASSIGNERS, group_size=group_size, **extra
    )
    if gamma is not None and (not hasattr(assigner, "gamma") or assigner.gamma != gamma):
        raise ValueError(
            f"algorithm.kwargs.gamma={gamma!r}: the credit assigner "
            f"{type(assigner).__name__} takes no gamma (ConstantCredit reads no reward); "
            "remove it"
        )
    if not isinstance(assigner, CreditAssigner):
        raise TypeError(
            f"algorithm.kwargs.credit: {type(assigner).__name__} has no compute(rollouts): "
            "not a credit assigner (libludic.training.credit_assignment.CreditAssigner)"
        )
    return assigner
