import pytest

from libludic.envs.arithmetic import generate_problem
from libludic.inference.request import InferenceSpec
from libludic.inference.sampling import SamplingConfig
from libludic.registry import build_registries
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.types import Rollout
from tests.fakes import ScriptedClient


def answer_if_even_seed(req):
    q = req.messages[-1]["content"]
    a, b = q[:-1].split("+")
    return str(int(a) + int(b)) if req.seed % 2 == 0 else "0"


async def test_generate_rollouts_seeds_groups_and_meta():
    client = ScriptedClient([answer_if_even_seed], policy_version=2)
    eng = RolloutEngine(*build_registries(client))
    reqs = [
        RolloutRequest(
            env=EnvSpec("arithmetic"),
            env_seed=10,
            sampling_seed=0,
            num_episodes=4,
            same_env_seed=True,
            meta={"group_id": "g"},
        ),
        RolloutRequest(env=EnvSpec("arithmetic"), env_seed=20, sampling_seed=100, num_episodes=2),
    ]
    rs = await eng.generate_rollouts(reqs, max_steps=1, concurrency=3)
    assert len(rs) == 6
    group = rs[:4]
    assert {r.meta["env_seed"] for r in group} == {10} and {r.group_id for r in group} == {"g"}
    assert [r.meta["sampling_seed"] for r in group] == [0, 1, 2, 3]
    assert [r.meta["env_seed"] for r in rs[4:]] == [20, 21]
    # even seeds answer right; the agent's first call is seeded with the episode's sampling
    # seed (0, 1, 2, 3: call c adds c * CALL_SEED_STRIDE), so episodes 0 and 2 score
    assert [r.total_reward for r in group] == [1.0, 0.0, 1.0, 0.0]
    assert [req.seed for req in client.requests[:4]] == [0, 1, 2, 3]
    assert all(r.steps[0].policy_version == 2 for r in rs)
    assert all(r.meta["request_id"] == reqs[0].id for r in group)
    # round trip through plain dicts
    assert Rollout.from_dict(rs[0].to_dict()).to_dict() == rs[0].to_dict()


async def test_inference_spec_reaches_the_request():
    client = ScriptedClient(["1"])
    eng = RolloutEngine(*build_registries(client))
    spec = InferenceSpec(sampling=SamplingConfig(temperature=1.0, max_tokens=5))
    await eng.generate_rollouts(
        [RolloutRequest(env=EnvSpec("arithmetic"), env_seed=1, inference=spec)], max_steps=1
    )
    assert (
        client.requests[0].sampling.max_tokens == 5
        and client.requests[0].sampling.temperature == 1.0
    )


async def test_unknown_kinds_name_the_registered_ones():
    eng = RolloutEngine(*build_registries(ScriptedClient(["1"])))
    with pytest.raises(KeyError, match="env kind='nope' is unknown; registered: .*arithmetic"):
        await eng.generate_rollouts([RolloutRequest(env=EnvSpec("nope"))], max_steps=1)
    with pytest.raises(
        KeyError, match="protocol kind='x' is unknown; registered: \\[multi_agent, single_agent\\]"
    ):
        await eng.generate_rollouts(
            [RolloutRequest(env=EnvSpec("arithmetic"), protocol=ProtocolSpec("x"))], max_steps=1
        )


async def test_episode_failure_propagates():
    class Boom(ScriptedClient):
        async def complete(self, request):
            raise RuntimeError("server exploded")

    eng = RolloutEngine(*build_registries(Boom(["x"])))
    with pytest.raises(RuntimeError, match="exploded"):
        await eng.generate_rollouts(
            [RolloutRequest(env=EnvSpec("arithmetic"), num_episodes=3)], max_steps=1
        )


async def test_multi_agent_through_registry():
    client = ScriptedClient(["1", "4", "2", "5", "3"])
    eng = RolloutEngine(*build_registries(client))
    req = RolloutRequest(
        env=EnvSpec("tic_tac_toe_2p"), protocol=ProtocolSpec("multi_agent", {"roles": ["X", "O"]})
    )
    rs = await eng.generate_rollouts([req], max_steps=9)
    assert sorted(r.meta["agent_id"] for r in rs) == ["O", "X"]
    assert sum(r.total_reward for r in rs) == 0.0


def test_request_validation_and_roundtrip():
    with pytest.raises(ValueError, match="num_episodes"):
        RolloutRequest(env=EnvSpec("arithmetic"), num_episodes=0)
    r = RolloutRequest(
        env=EnvSpec("arithmetic", {"digits": 3}),
        env_seed=1,
        inference=InferenceSpec(),
        meta={"group_id": "x"},
    )
    assert RolloutRequest.from_dict(r.to_dict()) == r
    assert generate_problem(1, 3) is not None
