"""A voice-agent framework's OpenAI Realtime client, unmodified, pointed at ``/v1/realtime``.

LiveKit Agents' OpenAI plugin (``livekit-plugins-openai``): its ``RealtimeModel`` is given omni_serve's
URL as ``base_url`` and its ``RealtimeSession`` runs on its own, without a LiveKit room or server,
as an ``AgentSession`` drives it: microphone frames go in through ``push_audio``, the server's VAD
ends the turn and answers, and the reply arrives as the plugin's ``GenerationCreatedEvent`` (text and
audio streams); ``generate_reply`` asks for a response and waits for the one answering it.
The audio frames the plugin yields are read back by libsndfile; the transcript it assembled is
compared with the server's own record of the reply (``response.done``).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest

from tests.audio import spoken
from tests.test_realtime import MODEL, RATE, decode_pcm, silence
from tests.test_realtime import graph as graph  # the fixture: the same deployment, no redeploy

pytestmark = pytest.mark.integration


async def _reply(generation: Any) -> tuple[str, bytes, list[Any]]:
    """One generation's text and audio as the plugin streams them to an agent (text and audio read at once)."""
    message = await generation.message_stream.__anext__()

    async def text() -> str:
        return "".join([delta async for delta in message.text_stream])

    async def audio() -> list[Any]:
        return [frame async for frame in message.audio_stream]

    said, frames = await asyncio.gather(text(), audio())
    return said, b"".join(bytes(f.data) for f in frames), frames


def _check_audio(pcm: bytes, frames: list[Any]) -> None:
    assert frames and all(f.sample_rate == RATE and f.num_channels == 1 for f in frames)
    samples = decode_pcm([base64.b64encode(pcm).decode()])
    assert len(samples) == sum(f.samples_per_channel for f in frames) >= 1920
    assert float(np.sqrt(np.mean(samples**2))) > 1e-4, "the reply's audio is silent"


def test_livekit_realtime_model_talks_to_omni_serve(graph) -> None:
    from livekit import rtc
    from livekit.plugins.openai.realtime import RealtimeModel
    from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad

    speech = silence(600) + spoken("Hello, how are you today?") + silence(1200)

    async def talk() -> tuple[list[tuple[str, bytes, list[Any], dict[str, Any]]], list[dict[str, Any]], list[Any]]:
        model = RealtimeModel(
            model=MODEL,
            base_url=f"{graph.base_url}/v1",
            api_key="unused",
            voice="alloy",
            modalities=["audio"],
            turn_detection=ServerVad(type="server_vad", silence_duration_ms=400),
            input_audio_transcription=None,
        )
        session = model.session()
        seen: list[dict[str, Any]] = []  # the server's events as the plugin received them
        errors: list[Any] = []
        generations: asyncio.Queue[Any] = asyncio.Queue()
        done: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def received(event: dict[str, Any]) -> None:
            seen.append(event)
            if event["type"] == "response.done":
                done.put_nowait(event["response"])

        session.on("openai_server_event_received", received)
        session.on("error", errors.append)
        session.on("generation_created", generations.put_nowait)
        try:
            async with asyncio.timeout(240):
                await session.update_instructions("Answer briefly.")
                # A spoken turn, as an agent forwards a room's microphone track: 100 ms frames.
                step = RATE // 10 * 2
                for start in range(0, len(speech), step):
                    chunk = speech[start : start + step]
                    frame = rtc.AudioFrame(chunk, RATE, 1, len(chunk) // 2)
                    session.push_audio(frame)
                heard = await generations.get()
                assert not heard.user_initiated  # the server's VAD started it
                replies = [(*await _reply(heard), await done.get())]
                # A reply the agent asks for: the plugin waits for the response.created answering it.
                asked = await asyncio.wait_for(session.generate_reply(instructions="Say goodbye."), 30)
                assert asked.user_initiated
                replies.append((*await _reply(asked), await done.get()))
        finally:
            await session.aclose()
            await model.aclose()
        return replies, seen, errors

    replies, seen, errors = asyncio.run(talk())
    assert not errors, errors
    kinds = [e["type"] for e in seen]
    assert kinds[0] == "session.created" and "session.updated" in kinds
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("response.created")
    assert len(replies) == 2 and kinds.count("response.done") == 2
    spoke = 0
    for said, pcm, frames, response in replies:
        length = {"type": "incomplete", "reason": "max_output_tokens"}  # the tiny thinker rarely samples EOS
        assert response["status"] == "completed" or response["status_details"] == length, response
        # The transcript the plugin assembled is the one the server recorded for the reply.
        assert said and said == response["output"][0]["content"][0]["transcript"]
        # The audio the plugin yielded is every byte the server sent for this response, in order.
        audio = [e for e in seen if e["type"] == "response.output_audio.delta"]
        sent = [e["delta"] for e in audio if e["response_id"] == response["id"]]
        assert pcm == b"".join(base64.b64decode(d) for d in sent)
        if sent:  # the random-weight talker (sampling, unseeded: the plugin sends no seed) may stop at once
            _check_audio(pcm, frames)
            spoke += 1
    assert spoke, "neither reply had audio"
