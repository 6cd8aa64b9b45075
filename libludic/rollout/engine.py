"""RolloutEngine: turns RolloutRequests into Rollouts, many episodes at once.

Registries map a spec ``kind`` to a factory: ``env_registry[kind](**env.kwargs) ->
LudicEnv`` and ``protocol_registry[kind](inference=InferenceSpec|None, **kwargs) ->
InteractionProtocol``, plus ``agent=AgentSpec`` when the request's protocol names one
(a factory that builds no agents may then reject it); ``reward_registry[kind](spec) ->
score function`` for a request's reward functions (libludic/scoring; built once per spec
and reused). A fresh env and protocol (with fresh agents) is built for every episode, so
episodes share no state and may run concurrently.

Determinism: episode ``i`` of a request uses env seed ``env_seed`` when
``same_env_seed`` else ``env_seed + i``, and sampling seed ``sampling_seed + i``; with a
backend that honours per-request seeds the same requests give the same rollouts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from libludic.envs.env import LudicEnv
from libludic.interaction.base import InteractionProtocol
from libludic.requests import RewardSpec, RolloutRequest
from libludic.saw import SAWBatch
from libludic.scoring.base import ScoreFn, apply_rewards
from libludic.types import Rollout

EnvFactory = Callable[..., LudicEnv[Any, Any, Any]]
ProtocolFactory = Callable[..., InteractionProtocol]


class RolloutEngine:
    def __init__(
        self,
        env_registry: Mapping[str, EnvFactory],
        protocol_registry: Mapping[str, ProtocolFactory],
        reward_registry: Mapping[str, Callable[..., ScoreFn]] | None = None,
    ) -> None:
        self.env_registry = env_registry
        self.protocol_registry = protocol_registry
        self.reward_registry = reward_registry if reward_registry is not None else {}
        self._reward_fns: dict[str, ScoreFn] = {}  # canonical spec -> its built function

    @staticmethod
    def _lookup(registry: Mapping[str, Any], kind: str, what: str, req: RolloutRequest) -> Any:
        try:
            return registry[kind]
        except KeyError as e:
            detail = e.args[0] if e.args and e.args[0] != kind else None
            raise KeyError(
                f"request {req.id}: "
                + (detail or f"unknown {what} kind {kind!r}; registered: {sorted(registry)}")
            ) from None

    def _make(self, req: RolloutRequest) -> tuple[LudicEnv[Any, Any, Any], InteractionProtocol]:
        env_factory = self._lookup(self.env_registry, req.env.kind, "env", req)
        proto_factory = self._lookup(self.protocol_registry, req.protocol.kind, "protocol", req)
        env = env_factory(**req.env.kwargs)
        extra: dict[str, Any] = {} if req.protocol.agent is None else {"agent": req.protocol.agent}
        proto = proto_factory(inference=req.inference, **req.protocol.kwargs, **extra)
        return env, proto

    def reward_fns(self, req: RolloutRequest, spec: RewardSpec) -> dict[str, ScoreFn]:
        """name -> score function of each of ``spec``'s functions (built once per process)."""
        out = {}
        for f in spec.functions:
            key = json.dumps(f.to_dict(), sort_keys=True, default=repr)
            if key not in self._reward_fns:
                builder = self._lookup(self.reward_registry, f.kind, "reward", req)
                self._reward_fns[key] = builder(f)
            out[f.name] = self._reward_fns[key]
        return out

    async def run_episode(self, req: RolloutRequest, episode: int, max_steps: int) -> list[Rollout]:
        env_seed: int | None = None
        if req.env_seed is not None:
            env_seed = req.env_seed if req.same_env_seed else req.env_seed + episode
        sampling_seed = None if req.sampling_seed is None else req.sampling_seed + episode
        env, proto = self._make(req)
        try:
            rollouts = await proto.run(
                env, max_steps=max_steps, env_seed=env_seed, sampling_seed=sampling_seed
            )
        finally:
            env.close()
        if req.reward is not None:
            await apply_rewards(rollouts, req.reward, self.reward_fns(req, req.reward))
        for r in rollouts:
            meta: dict[str, Any] = dict(req.meta)
            meta.update(r.meta)
            meta.update(
                request_id=req.id,
                episode_index=episode,
                env_kind=req.env.kind,
                env_seed=env_seed,
                sampling_seed=sampling_seed,
            )
            meta.setdefault("group_id", req.meta.get("group_id"))
            r.meta = meta
        return rollouts

    async def generate_rollouts(
        self,
        requests: Sequence[RolloutRequest],
        max_steps: int,
        concurrency: int = 8,
    ) -> list[Rollout]:
        """Run every episode of every request, at most ``concurrency`` at once.

        Rollouts come back in request order, then episode order. The first episode that
        raises cancels the rest and the error propagates (nothing partial is returned).
        """
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} must be >= 1")
        sem = asyncio.Semaphore(concurrency)
        jobs = [(req, i) for req in requests for i in range(req.num_episodes)]

        async def one(req: RolloutRequest, i: int) -> list[Rollout]:
            async with sem:
                return await self.run_episode(req, i, max_steps)

        tasks = [asyncio.create_task(one(r, i)) for r, i in jobs]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [r for rs in results for r in rs]

    async def generate_batch(
        self,
        requests: Sequence[RolloutRequest],
        algorithm: Any,
        sample_filter: Callable[..., bool] | None = None,
        *,
        max_steps: int = 1,
        concurrency: int = 8,
    ) -> SAWBatch:
        """Rollouts -> ``algorithm.to_saw_items`` (reward shaping, preprocess, credit,
        filter, the whole batch's statistics over these rollouts) -> SAWBatch.

        The positional order is the spec's ``(requests, algorithm, sample_filter)``;
        ``max_steps`` and ``concurrency`` (Ludic extras) are keyword-only so a spec-style
        ``generate_batch(reqs, algo, keep)`` can never bind the filter to ``max_steps``.
        """
        rollouts = await self.generate_rollouts(requests, max_steps, concurrency)
        items = algorithm.to_saw_items(rollouts, sample_filter)
        rewards = [r.total_reward for r in rollouts]  # the task's, over every rollout generated
        return SAWBatch(
            items=items,
            meta={
                "num_rollouts": len(rollouts),
                "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            },
        )
