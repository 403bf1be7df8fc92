"""Image replies encode their PNGs off the ingress event loop (up to 4 x 2048^2 images: seconds of CPU a request).

The encoder is wrapped to record the thread it runs on; the reply is built on an event loop as the ingress
builds it. What is asserted is where the work ran, not how long it took.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from omni_serve.api.openai import images
from omni_serve.api.openai.chat import ChatReply
from omni_serve.types import FinishReason, Modality, StageOutput


@pytest.fixture
def encoded_on(monkeypatch) -> list[threading.Thread]:
    """The threads each PNG was encoded on."""
    threads: list[threading.Thread] = []
    encode = images.encode_png

    def recording(image: np.ndarray) -> bytes:
        threads.append(threading.current_thread())
        return encode(image)

    monkeypatch.setattr(images, "encode_png", recording)
    return threads


async def outputs(n: int = 2) -> AsyncIterator[StageOutput]:
    pictures = [np.full((16, 16, 3), i, dtype=np.uint8) for i in range(n)]
    yield StageOutput(stage="dit", images=pictures, finished=True, finish_reason=FinishReason.STOP)


def on_a_loop(build: Any) -> tuple[Any, threading.Thread]:
    async def main() -> tuple[Any, threading.Thread]:
        return await build(), threading.current_thread()

    return asyncio.run(main())


def chat_reply() -> ChatReply:
    return ChatReply("r1", "tiny", {Modality.IMAGE}, "wav", None)


def test_the_images_response_encodes_in_a_worker_thread(encoded_on) -> None:
    body, loop_thread = on_a_loop(lambda: images.ImagesReply().json(outputs()))
    assert len(body["data"]) == 2 and all(item["b64_json"] for item in body["data"])
    assert len(encoded_on) == 2 and loop_thread not in encoded_on


def test_a_chat_reply_with_images_encodes_in_a_worker_thread(encoded_on) -> None:
    body, loop_thread = on_a_loop(lambda: chat_reply().json(outputs()))
    assert [part["type"] for part in body["choices"][0]["message"]["content"]] == ["image_url", "image_url"]
    assert len(encoded_on) == 2 and loop_thread not in encoded_on


def test_a_streamed_chat_reply_with_images_encodes_in_a_worker_thread(encoded_on) -> None:
    async def events() -> list[str]:
        return [event async for event in chat_reply().stream(outputs())]

    sent, loop_thread = on_a_loop(events)
    assert sum("image_url" in event for event in sent) == 1 and sent[-1] == "data: [DONE]\n\n"
    assert len(encoded_on) == 2 and loop_thread not in encoded_on
