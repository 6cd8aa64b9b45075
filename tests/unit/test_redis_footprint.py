"""Redis's footprint as metrics (bounded growth, "the figures are metrics"): memory
against maxmemory, and keys with an expiry (de-dup markers) apart from keys without (a leak
shows as a count without expiry that keeps rising)."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from libludic import transport
from services.common.lifecycle import update_footprint_gauges
from services.feeder import main as feeder_main
from services.feeder.settings import FeederSettings


def gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_the_gauges_follow_memory_and_keys_with_and_without_expiry(redis_url) -> None:
    r = transport.connect(redis_url)
    try:
        await r.config_set("maxmemory", 64 * 2**20)
        before = await update_footprint_gauges(r)
        assert before["keys_with_expiry"] == before["keys_without_expiry"] == 0
        # 3 markers with a TTL (what Keys.done writes), 2 keys without (a stream, a hash)
        for i in range(3):
            await r.set(f"ludic:run:done:actor:{i}", "1", ex=3600)
        await r.xadd("ludic:run:requests", {"d": b"x" * 100_000})
        await r.hset("ludic:run:acct", "groups_requested", 1)
        after = await update_footprint_gauges(r)
        assert after["keys_with_expiry"] == 3 and after["keys_without_expiry"] == 2
        assert after["maxmemory"] == 64 * 2**20
        assert after["used_memory"] > before["used_memory"] + 100_000  # the 100 kB entry
        assert gauge("ludic_redis_keys", expiry="yes") == 3
        assert gauge("ludic_redis_keys", expiry="no") == 2
        assert gauge("ludic_redis_memory_bytes", kind="max") == 64 * 2**20
        assert gauge("ludic_redis_memory_bytes", kind="used") == after["used_memory"]
        await r.delete("ludic:run:requests", "ludic:run:done:actor:0")
        gone = await update_footprint_gauges(r)
        assert (gone["keys_with_expiry"], gone["keys_without_expiry"]) == (2, 1)
    finally:
        await r.aclose()


async def test_a_redis_that_refuses_info_turns_the_gauges_off_not_the_feeder(
    redis_url, caplog
) -> None:
    """A Redis whose ACL denies INFO (a managed Redis, a least-privilege user): the feeder
    logs that the footprint gauges are off and feeds on."""
    admin = transport.connect(redis_url)
    try:
        await admin.execute_command(
            "ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info"
        )
        host_port = redis_url.split("@")[-1].split("//")[-1]
        s = FeederSettings(
            redis_url=f"redis://noinfo:pw@{host_port}",
            run_id="noinfo",
            tasks=[
                {
                    "env": {"kind": "arithmetic", "kwargs": {"digits": 1}},
                    "inference": {"sampling": {"max_tokens": 4}},
                }
            ],
            algorithm={"group_size": 2},
            high_water=3,
            max_requests=3,
            metrics_port=0,
            poll_s=0.05,
            max_head_offpolicyness=None,
        )
        added = await asyncio.wait_for(feeder_main.run(s), 30)
        assert added == 3
        assert await admin.xlen(transport.Keys("noinfo").requests) == 3
        assert "footprint gauges off: INFO refused" in caplog.text
    finally:
        await admin.aclose()
