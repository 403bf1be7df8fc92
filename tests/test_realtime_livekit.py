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
from tests.realtime_client import MODEL, RATE, decode_pcm, silence
from tests.realtime_client import graph as graph  # the fixture: the same deployment, no redeploy
from tests.vocoder import tiny_lag, whole_frames

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
    """Whole codec frames less the vocoder's lag: a reply of one frame (the unseeded talker may stop after it)
    is 1920 - lag samples, so the bound is whole frames, not one frame's 1920 samples."""
    assert frames and all(f.sample_rate == RATE and f.num_channels == 1 for f in frames)
    samples = decode_pcm([base64.b64encode(pcm).decode()])
    assert len(samples) == sum(f.samples_per_channel for f in frames)
    assert whole_frames(len(samples), tiny_lag()) >= 1
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


def test_livekit_function_tool_is_called_and_its_output_answered(graph) -> None:
    """An agent's ``@function_tool`` through the plugin: ``update_tools`` offers it (``session.tools``),
    ``generate_reply(tool_choice="required")`` gets the call as the generation's function stream, LiveKit's own
    ``execute_function_call`` runs the tool, ``update_chat_ctx`` sends its output back (a
    ``function_call_output`` item) and the next ``generate_reply`` is answered in audio.

    The tool takes no arguments (``raw_schema``, its object closed). The plugin sends no sampling fields, and the
    random tiny thinker, forced into the call's JSON, writes whitespace inside its braces until its ``max_tokens``
    (the chat and realtime tool tests bias whitespace away with ``logit_bias``; LiveKit cannot send one): the call
    arrives named, with the arguments the parser could close (none), in a response ``incomplete`` for
    ``max_output_tokens``, and LiveKit runs the tool with ``{}``, as it does for empty arguments."""
    from livekit.agents import llm
    from livekit.plugins.openai.realtime import RealtimeModel

    ran: list[str] = []
    schema = {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": False},
    }

    @llm.function_tool(raw_schema=schema)
    async def get_time(raw_arguments: dict[str, object]) -> str:
        ran.append(repr(raw_arguments))
        return "It is noon."

    async def talk() -> tuple[list[Any], tuple[str, bytes, list[Any]], list[dict[str, Any]], list[Any]]:
        model = RealtimeModel(
            model=MODEL,
            base_url=f"{graph.base_url}/v1",
            api_key="unused",
            voice="alloy",
            modalities=["audio"],
            turn_detection=None,
            input_audio_transcription=None,
        )
        session = model.session()
        seen: list[dict[str, Any]] = []
        errors: list[Any] = []
        done: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def received(event: dict[str, Any]) -> None:
            seen.append(event)
            if event["type"] == "response.done":
                done.put_nowait(event["response"])

        session.on("openai_server_event_received", received)
        session.on("error", errors.append)
        try:
            async with asyncio.timeout(240):
                await session.update_tools([get_time])
                ctx = session.chat_ctx.copy()
                ctx.add_message(role="user", content="What time is it?")
                await session.update_chat_ctx(ctx)
                asked = await asyncio.wait_for(session.generate_reply(tool_choice="required"), 60)
                calls = [call async for call in asked.function_stream]
                await done.get()
                results = []
                for call in calls:
                    tool_call = llm.FunctionToolCall(name=call.name, arguments=call.arguments, call_id=call.call_id)
                    results.append(await llm.utils.execute_function_call(tool_call, llm.ToolContext([get_time])))
                ctx = session.chat_ctx.copy()
                ctx.items.extend(r.fnc_call_out for r in results if r.fnc_call_out is not None)
                await session.update_chat_ctx(ctx)
                answered = await asyncio.wait_for(session.generate_reply(tool_choice="none"), 60)
                reply = await _reply(answered)
                await done.get()  # the reply's response.done, before the session closes
        finally:
            await session.aclose()
            await model.aclose()
        return calls, reply, seen, errors

    calls, (said, pcm, frames), seen, errors = asyncio.run(talk())
    assert not errors, errors
    (call,) = calls
    assert call.name == "get_time" and call.call_id
    assert len(ran) == 1  # LiveKit ran the tool
    created = [e["item"] for e in seen if e["type"] == "conversation.item.added"]
    (output,) = [i for i in created if i["type"] == "function_call_output"]
    assert (output["call_id"], output["output"]) == (call.call_id, "It is noon.")
    done = [e["response"] for e in seen if e["type"] == "response.done"]
    assert [[i["type"] for i in r["output"]] for r in done] == [["function_call"], ["message"]]
    assert done[0]["output"][0]["call_id"] == call.call_id and done[0]["output"][0]["arguments"] == call.arguments
    length = {"type": "incomplete", "reason": "max_output_tokens"}
    assert all(r["status"] == "completed" or r["status_details"] == length for r in done), done
    assert not [e for e in seen if e["type"] == "response.output_audio.delta" and e["response_id"] == done[0]["id"]]
    assert said and said == done[1]["output"][0]["content"][0]["transcript"]
    sent = [
        e["delta"] for e in seen if e["type"] == "response.output_audio.delta" and e["response_id"] == done[1]["id"]
    ]
    assert pcm == b"".join(base64.b64decode(d) for d in sent)
