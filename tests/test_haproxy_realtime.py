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
    """Each retrieval of an item with 4 MB of audio is a 5.3 MB event; the client reads none of them (the
    byte budget lets about seven through at once: 37 MB, over twice the bound).

    Its socket fills (the client buffers one message, the kernel a few MB), the events wait in the
    session's outbox, and past max_unsent_bytes the server ends the session: it is gone from the replica
    while the client has still read nothing, and what the replica held for it never passed the bound
    (plus the one event that passed it). The client sends no keepalive pings: it would close the
    connection itself when their pongs, queued behind what it does not read, never come. (Serve's
    direct ingress runs uvicorn, whose own pings end such a connection after ~40 s whatever it buffered;
    the bound acts on bytes, sooner.) A hang guard, not a timing, bounds the wait."""
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
            await asyncio.to_thread(wait_until, ended, 120, "the server to end the session")

    unsent: list[int] = []

    def ended() -> bool:
        stats = realtime_stats(tiny_omni)
        unsent.extend(stats["unsent_bytes"])
        return stats["sessions"] == 0

    asyncio.run(run())
    one_event = len(audio) + 1024  # a retrieval: the item's base64 audio and its JSON
    assert max(unsent, default=0) <= LIMITS.max_unsent_bytes + one_event, unsent
