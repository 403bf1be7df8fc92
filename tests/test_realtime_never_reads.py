"""A realtime client that never reads, behind Serve's HAProxy ingress (the session cluster's, as `make serve`'s):
the server ends the session while the client has read nothing (before the outbox, the session waited on the
client and hung).

What ends it here is not shown to be ``realtime.max_unsent_bytes``: with that bound switched off the
test still passes, the replica's unsent bytes sampled at 0 throughout (12 retrievals at once; and 40
paced within the byte budget with the client's receive buffer fixed at 256 KiB, 212 MB unread), and
the session ends when uvicorn's keepalive pings go unanswered. The bound itself is tested in process
(tests/test_realtime_limits.py); docs/realtime.md says so.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.realtime_client import realtime_stats, realtime_url

pytestmark = [pytest.mark.integration]


def test_a_client_that_never_reads_is_disconnected(tiny_omni: Any) -> None:
    """Each retrieval of an item with 4 MB of audio is a 5.3 MB event; the client reads none of them.

    The client sends no keepalive pings: it would close the connection itself when their pongs,
    queued behind what it does not read, never come. A hang guard, not a timing, bounds the wait."""
    import websockets

    audio = base64.b64encode(bytes(4_000_000)).decode()

    async def run() -> None:
        async with websockets.connect(realtime_url(tiny_omni), max_size=None, max_queue=1, ping_interval=None) as ws:
            await ws.recv()  # session.created
            item = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {**item, "id": "big"}}))
            for _ in range(2):  # its .added and .done
                assert json.loads(await ws.recv())["type"].startswith("conversation.item.")
            assert (await asyncio.to_thread(realtime_stats, tiny_omni))["sessions"] == 1
            for _ in range(12):  # never read
                await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "big"}))
            await asyncio.to_thread(
                wait_until, lambda: realtime_stats(tiny_omni)["sessions"] == 0, 120, "the server to end the session"
            )

    asyncio.run(run())
    assert realtime_stats(tiny_omni)["held_bytes"] == []
