"""/livez: alive while the event loop answers, whatever the store; what a liveness probe asks."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx2
import pytest
from conftest import running_stack

from mcp_ha.ops.stack import Stack


@pytest.mark.timeout(60)
async def test_livez_answers_while_the_loop_runs_and_not_from_a_hung_replica(healed_stack: Stack) -> None:
    replica = healed_stack.config.replica_names()[0]
    port = healed_stack.service(replica).port
    url = f"http://127.0.0.1:{port}/livez"
    async with httpx2.AsyncClient(timeout=2) as http:
        alive = await http.get(url)
        assert alive.status_code == 200 and alive.json() == {"status": "alive", "instance": replica}
        # Clients never see it: it is each replica's own, for the platform's probe.
        assert (await http.get(f"http://127.0.0.1:{healed_stack.config.http_port}/livez")).status_code == 404

        healed_stack.signal(replica, signal.SIGSTOP)
        # A TCP probe still connects (the kernel accepts for a stopped process): it would pass forever.
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
        writer.close()
        with pytest.raises(httpx2.TimeoutException):
            await http.get(url)

        healed_stack.signal(replica, signal.SIGCONT)
        assert (await http.get(url, timeout=10)).status_code == 200


@pytest.mark.redis
@pytest.mark.slow
async def test_livez_answers_while_the_store_is_down_and_health_does_not(tmp_path: Path) -> None:
    # A stack of its own: stopping the shared stack's Redis would reach the tests after this one.
    with running_stack(tmp_path, replicas=1) as stack:
        replica = stack.config.replica_names()[0]
        port = stack.service(replica).port
        stack.stop("redis")
        async with httpx2.AsyncClient(timeout=10) as http:
            assert (await http.get(f"http://127.0.0.1:{port}/livez")).status_code == 200
            deadline = asyncio.get_running_loop().time() + 30
            while (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                assert asyncio.get_running_loop().time() < deadline, "/health never saw the store gone"
                await asyncio.sleep(0.2)
            assert (await http.get(f"http://127.0.0.1:{port}/livez")).status_code == 200
