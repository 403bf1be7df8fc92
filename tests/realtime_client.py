"""A realtime client of the tiny graph: audio in and out, the events of a kind, a raw websocket."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import one_replica_per_stage

MODEL = "tiny-qwen3-omni"


RATE = 24000


@pytest.fixture(scope="module")
def graph(tiny_omni: Any) -> Any:
    return one_replica_per_stage(tiny_omni)


def silence(ms: int) -> bytes:
    return bytes(RATE * 2 * ms // 1000)


def decode_pcm(deltas: list[str]) -> np.ndarray:
    """The reply's audio read by libsndfile as raw 16-bit 24 kHz mono (not by the server's encoder)."""
    pcm = b"".join(base64.b64decode(d) for d in deltas)
    samples, rate = sf.read(io.BytesIO(pcm), format="RAW", subtype="PCM_16", samplerate=RATE, channels=1)
    assert rate == RATE
    return samples


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


class Raw:
    """A raw websocket session (``websockets``): sends what the official client would refuse to send."""

    def __init__(self, ws: Any):
        self.ws = ws

    async def send(self, event: dict[str, Any] | str) -> None:
        await self.ws.send(event if isinstance(event, str) else json.dumps(event))

    async def recv(self) -> dict[str, Any]:
        return json.loads(await self.ws.recv())

    async def until(self, last: str, timeout: float = 120) -> list[dict[str, Any]]:
        return await events_until(self.recv, last, timeout)

    async def error_for(self, event: dict[str, Any] | str) -> dict[str, Any]:
        await self.send(event)
        return (await self.until("error"))[-1]["error"]

    async def reply(self, text: str, **response: Any) -> list[dict[str, Any]]:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        await self.send({"type": "conversation.item.create", "item": item})
        await self.send({"type": "response.create", "response": response})
        return await self.until("response.done")


def realtime_url(graph: Any) -> str:
    return f"{graph.base_url.replace('http', 'ws', 1)}/v1/realtime?model={MODEL}"


def realtime_stats(graph: Any) -> dict[str, Any]:
    return graph.handle("ingress").realtime_stats.remote().result()


async def events_until(recv: Any, last: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Server events (as dicts) up to and including the first of type ``last``."""
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while True:
            event = await recv()
            seen.append(event)
            if event["type"] == last:
                return seen
