"""The router's health probes over real HTTP, against small aiohttp servers standing in for the
instances' `/health` (the router's policy is under test, not the instances): an instance that is
slow to answer stays in rotation for a while, one that is gone or says it is unhealthy leaves at
once, and either comes back at its next good answer (or when a request finding none of its kind
in rotation has them probed again)."""

from __future__ import annotations

import asyncio

import aiohttp

from dserve.runtime.router import SLOW_PROBES_TO_REMOVE, Router
from dserve.runtime.server_config import RouterConfig
from tests.runtime.stubs import StubInstance


def test_slow_gone_and_unhealthy_instances():
    async def scenario():
        prefill, decode = StubInstance(), StubInstance()
        for inst in (prefill, decode):
            await inst.start()
        # probes time out after 1 s
        router = Router([prefill.url], [decode.url], RouterConfig(health_interval_s=0.2))
        router.session = aiohttp.ClientSession()
        try:
            await router.check_all()
            assert router.prefills[0].healthy and router.decodes[0].healthy
            assert router.prefills[0].bootstrap_port == 1

            decode.delay_s = 1.5  # busy: each probe times out
            for _ in range(SLOW_PROBES_TO_REMOVE - 1):
                await router.check_all()
                assert router.decodes[0].healthy, "a slow instance stays in rotation for a while"
            await router.check_all()
            assert not router.decodes[0].healthy and router.pick("decode") is None
            decode.delay_s = 0.0
            # a request meanwhile probes again rather than fail on the last probe's news
            assert await router.pick_pair() == (router.prefills[0], router.decodes[0])
            assert router.decodes[0].healthy, "back at its first good answer"

            decode.status = 503  # the instance says it is broken: out at once
            await router.check_all()
            assert not router.decodes[0].healthy
            decode.status = 200
            await router.check_all()
            assert router.decodes[0].healthy

            await prefill.stop()  # gone: connection refused, out at once
            await router.check_all()
            assert not router.prefills[0].healthy and router.pick("prefill") is None
            assert (await router.pick_pair())[0] is None, "probed again, still gone"
        finally:
            await router.session.close()
            await decode.stop()

    asyncio.run(scenario())
