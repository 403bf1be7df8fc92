"""A realtime client that never reads, behind Serve's HAProxy ingress: the session ends once the events it
left unread pass ``realtime.max_unsent_bytes``.

Only here can the ingress see it: HAProxy hands the websocket to the ingress replica's own HTTP server,
so the replica writes the socket itself and its writes wait when the client's TCP window is full.
Behind Serve's Python proxy every send is handed to the proxy at once (Ray 2.60 relays a websocket's
messages through a streaming generator without backpressure): the proxy buffers what the client
does not read (docs/realtime.md says so). Runs in the HAProxy session (``pytest -m haproxy``).
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from omni_serve.graph.config import RealtimeConfig
from tests.conftest import wait_until
from tests.test_realtime import realtime_url
from tests.test_realtime_hostile import realtime_stats

pytestmark = [pytest.mark.haproxy, pytest.mark.integration]

LIMITS = RealtimeConfig()


def test_a_client_that_never_reads_is_disconnected(tiny_omni: Any) -> None:
    """Each retrieval of an item with 8 MB of audio is an 11 MB event; the client reads none of them.

    Its socket fills (the client buffers one message, the kernel a few MB), the events wait in the
    session's outbox, and past max_unsent_bytes the server ends the session: it is gone from the replica
    while the client has still read nothing. A hang guard, not a timing, bounds the wait."""
    import websockets

    audio = base64.b64encode(bytes(8_000_000)).decode()

    async def run() -> None:
        async with websockets.connect(realtime_url(tiny_omni), max_size=None, max_queue=1) as ws:
            await ws.recv()  # session.created
            item = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {**item, "id": "big"}}))
            for _ in range(2):  # its .added and .done
                assert json.loads(await ws.recv())["type"].startswith("conversation.item.")
            assert (await asyncio.to_thread(realtime_stats, tiny_omni))["sessions"] == 1
            for _ in range(8):  # 88 MB of events, never read
                await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "big"}))
            await asyncio.to_thread(
                wait_until, lambda: realtime_stats(tiny_omni)["sessions"] == 0, 120, "the server to end the session"
            )

    asyncio.run(run())
    assert realtime_stats(tiny_omni)["held_bytes"] == []
