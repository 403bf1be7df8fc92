"""`/v1/realtime`: OpenAI's Realtime protocol over the stage graph, spoken to by real clients.

The official ``openai`` package's realtime client speaks a turn synthesized by espeak-ng; the
server's VAD (Silero) hears it, the graph answers in audio that an independent decoder reads.
Barge-in is asserted on the engines' state, as tests/test_cancellation.py asserts a disconnect.
Bad events are sent raw (``websockets``), each answered by an ``error`` event naming the event and
the field, the session still usable afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from tests.audio import spoken
from tests.conftest import wait_until
from tests.in_flight import idle, stats
from tests.realtime_client import (
    MODEL,
    RATE,
    Raw,
    decode_pcm,
    events_until,
    of,
    realtime_url,
    silence,
)
from tests.realtime_client import graph as graph
from tests.vocoder import tiny_lag, whole_frames

pytestmark = pytest.mark.integration

CHUNK = RATE * 2 // 10  # 100 ms of pcm16 per append, as a microphone client sends
LONG_TALK = {"talker": {"temperature": 0.0, "max_tokens": 4000}}  # greedy tiny talker: never stops by itself


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---- the official client: a spoken turn, heard by the VAD, answered in audio ------------------------


def test_spoken_turn_with_the_openai_client(graph) -> None:
    from openai import AsyncOpenAI

    speech = spoken("Hello, how are you today?")
    lead = 600  # ms of silence before the speech

    async def talk() -> list[dict[str, Any]]:
        client = AsyncOpenAI(base_url=f"{graph.base_url}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as conn:

            async def recv() -> dict[str, Any]:
                return json.loads(await conn.recv_bytes())

            created = await recv()
            assert created["type"] == "session.created" and created["session"]["model"] == MODEL
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": "Answer briefly.",
                    "output_modalities": ["audio"],
                    "audio": {
                        "input": {
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 400},
                            "transcription": {"model": MODEL, "language": "en"},
                        },
                        "output": {"voice": "alloy"},
                    },
                }
            )
            updated = await recv()
            assert updated["type"] == "session.updated", updated
            assert updated["session"]["audio"]["output"]["voice"] == "alloy"
            audio = silence(lead) + speech + silence(1200)
            for start in range(0, len(audio), CHUNK):
                await conn.input_audio_buffer.append(audio=b64(audio[start : start + CHUNK]))
            events = await events_until(recv, "response.done")
            if not of(events, "conversation.item.input_audio_transcription.completed"):
                events += await events_until(recv, "conversation.item.input_audio_transcription.completed")
            return events

    events = asyncio.run(talk())
    kinds = [e["type"] for e in events]
    (started,) = of(events, "input_audio_buffer.speech_started")
    (stopped,) = of(events, "input_audio_buffer.speech_stopped")
    speech_ms = len(speech) * 1000 // (RATE * 2)
    # audio_start_ms includes the 300 ms prefix padding; Silero needs a window or two to decide.
    assert lead - 300 - 100 <= started["audio_start_ms"] <= lead + 300, started
    assert lead + speech_ms - 700 <= stopped["audio_end_ms"] <= lead + speech_ms + 500, (stopped, speech_ms)
    (committed,) = of(events, "input_audio_buffer.committed")
    assert committed["item_id"] == started["item_id"] == stopped["item_id"]
    user = of(events, "conversation.item.added")[0]["item"]
    assert user["role"] == "user" and user["content"][0]["type"] == "input_audio"
    assert kinds.index("response.created") > kinds.index("input_audio_buffer.committed")

    transcript = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
    deltas = [e["delta"] for e in of(events, "response.output_audio.delta")]
    assert transcript and deltas
    assert kinds.index("response.output_audio_transcript.delta") < kinds.index("response.output_audio_transcript.done")
    samples = decode_pcm(deltas)
    assert whole_frames(len(samples), tiny_lag()) >= 1  # whole codec frames less the vocoder's lag
    assert float(np.sqrt(np.mean(samples**2))) > 1e-4, "the reply's audio is silent"
    # input_audio_transcription: the transcription route's request over the committed turn.
    (heard,) = of(events, "conversation.item.input_audio_transcription.completed")
    said = "".join(e["delta"] for e in of(events, "conversation.item.input_audio_transcription.delta"))
    assert heard["item_id"] == committed["item_id"] and heard["transcript"] == said and said
    assert heard["usage"]["input_tokens"] > 20
    done = of(events, "response.done")[0]["response"]
    # The tiny random thinker rarely samples EOS: its reply ends at max_tokens, which OpenAI calls incomplete.
    length = {"type": "incomplete", "reason": "max_output_tokens"}
    assert done["status"] == "completed" or done["status_details"] == length, done
    assert done["output"][0]["content"][0]["transcript"] == transcript
    usage = done["usage"]
    # The user's 1.7 s of audio reached the thinker as audio: more prompt tokens than the text around it.
    assert usage["input_tokens"] > 20 and usage["output_tokens"] > 0, usage
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


# ---- barge-in: speech during a response cancels every stage call -------------------------------------


def test_barge_in_cancels_every_stage_and_truncates_the_reply(graph) -> None:
    import websockets

    wait_until(lambda: idle(graph), 90, "idle stages before the test")
    before = stats(graph)
    speech = spoken("Stop, please stop talking.")
    url = f"{graph.base_url.replace('http', 'ws', 1)}/v1/realtime?model={MODEL}"

    async def talk() -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
        async with websockets.connect(url, max_size=None) as ws:

            async def recv() -> dict[str, Any]:
                return json.loads(await ws.recv())

            async def send(event: dict[str, Any]) -> None:
                await ws.send(json.dumps(event))

            await events_until(recv, "session.created")
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a story."}]}
            await send({"type": "conversation.item.create", "item": item})
            await send({"type": "response.create", "response": {"stage_sampling": LONG_TALK}})
            first = await events_until(recv, "response.output_audio.delta")

            def in_talker_and_code2wav() -> bool:
                now = stats(graph)
                return (
                    now["talker"]["running"] == 1
                    and now["code2wav"]["requests_total"] > (before["code2wav"]["requests_total"])
                )

            await asyncio.to_thread(wait_until, in_talker_and_code2wav, 90, "the reply to reach talker and code2wav")
            audio = speech + silence(1000)
            for start in range(0, len(audio), CHUNK):
                await send({"type": "input_audio_buffer.append", "audio": b64(audio[start : start + CHUNK])})
            cancelled = await events_until(recv, "response.done")
            reply_id = first[-1]["item_id"]
            await send({"type": "conversation.item.retrieve", "item_id": reply_id})
            retrieved = (await events_until(recv, "conversation.item.retrieved"))[-1]["item"]
            # The VAD's turn then gets its own response (the talker's default length: it ends).
            nxt = await events_until(recv, "response.done")
            # The client's own truncation (what it played): half the audio that was sent.
            sent_ms = len(base64.b64decode(retrieved["content"][0]["audio"])) * 1000 // (RATE * 2)
            cut = {"type": "conversation.item.truncate", "item_id": reply_id, "content_index": 0}
            await send({**cut, "audio_end_ms": sent_ms // 2})
            truncated = (await events_until(recv, "conversation.item.truncated"))[-1]
            assert truncated["audio_end_ms"] == sent_ms // 2 and truncated["item_id"] == reply_id
            await send({"type": "conversation.item.retrieve", "item_id": reply_id})
            halved = (await events_until(recv, "conversation.item.retrieved"))[-1]["item"]["content"][0]
            assert len(base64.b64decode(halved["audio"])) == sent_ms // 2 * RATE // 1000 * 2
            words = retrieved["content"][0]["transcript"].split()
            assert (halved["transcript"] or "").split() == words[: len(words) * (sent_ms // 2) // sent_ms]
            return first + cancelled, retrieved, nxt

    events, retrieved, nxt = asyncio.run(talk())
    kinds = [e["type"] for e in events]
    done = events[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected", done
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.done")
    # The item keeps exactly the audio that was sent, and is marked incomplete.
    sent = b"".join(base64.b64decode(e["delta"]) for e in of(events, "response.output_audio.delta"))
    assert retrieved["status"] == "incomplete"
    assert base64.b64decode(retrieved["content"][0]["audio"]) == sent
    assert retrieved["content"][0]["transcript"] == "".join(
        e["delta"] for e in of(events, "response.output_audio_transcript.delta")
    )
    # Every engine dropped the cancelled request; code2wav stopped receiving its chunks early.
    wait_until(lambda: idle(graph), 90, "every stage to drop the cancelled response")
    assert nxt[-1]["response"]["status"] in ("completed", "incomplete"), nxt[-1]
    settled = stats(graph)
    time.sleep(2)
    assert stats(graph)["code2wav"]["requests_total"] == settled["code2wav"]["requests_total"]
    assert settled["talker"]["requests_total"] == before["talker"]["requests_total"] + 2
    assert settled["thinker"]["requests_total"] == before["thinker"]["requests_total"] + 2
    made = settled["code2wav"]["requests_total"] - before["code2wav"]["requests_total"]
    assert made < 4000 // 25 // 2, f"{made} code2wav calls: the talker was not aborted early"


# ---- the next turn sees the truncated history ----------------------------------------------------------


def test_the_next_turn_sees_the_truncated_history(graph) -> None:
    """After ``conversation.item.truncate``, the next response's thinker prompt holds the truncated reply.

    The prompt is observed without a hook in the session: a chat completion over the same turns (the
    truncated transcript as the assistant's turn) with ``return_prompt_text`` shows the prompt those
    turns make, and the session's seeded next reply matches it token for token and in prompt length.
    """
    import websockets
    from openai import OpenAI

    pinned = {"seed": 5, "max_output_tokens": 8, "output_modalities": ["text"]}

    async def talk() -> tuple[str, int, str, list[dict[str, Any]]]:
        async with websockets.connect(realtime_url(graph), max_size=None) as ws:
            s = Raw(ws)
            await s.until("session.created")
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a story."}]}
            await s.send({"type": "conversation.item.create", "item": item})
            await s.send({"type": "response.create", "response": {"stage_sampling": LONG_TALK}})
            reply_id = (await s.until("response.output_audio.delta"))[-1]["item_id"]
            await s.send({"type": "response.cancel"})
            await s.until("response.done")
            await s.send({"type": "conversation.item.retrieve", "item_id": reply_id})
            full = (await s.until("conversation.item.retrieved"))[-1]["item"]["content"][0]
            sent_ms = len(base64.b64decode(full["audio"])) * 1000 // (RATE * 2)
            cut = {"type": "conversation.item.truncate", "item_id": reply_id, "content_index": 0}
            await s.send({**cut, "audio_end_ms": sent_ms // 2})
            await s.until("conversation.item.truncated")
            await s.send({"type": "conversation.item.retrieve", "item_id": reply_id})
            kept = (await s.until("conversation.item.retrieved"))[-1]["item"]["content"][0]["transcript"]
            return full["transcript"], sent_ms, kept, await s.reply("Go on.", **pinned)

    full, sent_ms, kept, events = asyncio.run(talk())
    words = full.split()
    assert kept and kept.split() == words[: len(words) * (sent_ms // 2) // sent_ms], (full, kept)
    said = "".join(e["delta"] for e in of(events, "response.output_text.delta"))
    usage = events[-1]["response"]["usage"]
    turns = [
        {"role": "user", "content": "Tell a story."},
        {"role": "assistant", "content": kept},
        {"role": "user", "content": "Go on."},
    ]
    client = OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    reference = client.chat.completions.create(
        model=MODEL,
        messages=turns,  # type: ignore[arg-type]
        modalities=["text"],
        seed=5,
        max_completion_tokens=8,
        extra_body={"return_prompt_text": True},
    )
    prompt = reference.model_extra["prompt_text"]
    assert kept in prompt and " ".join(words[: len(kept.split()) + 1]) not in prompt, prompt
    assert usage["input_tokens"] == reference.usage.prompt_tokens, (usage, reference.usage)
    assert said == reference.choices[0].message.content


# ---- bad input: an error event naming the event and the field; the session goes on --------------------


def test_bad_events_get_error_events_and_the_session_goes_on(graph) -> None:
    import websockets

    wav = io.BytesIO()
    sf.write(wav, np.zeros(2400, dtype=np.float32), RATE, format="WAV")

    async def talk() -> None:
        async with websockets.connect(realtime_url(graph), max_size=None) as ws:
            s = Raw(ws)
            await s.until("session.created")
            error = await s.error_for("{not json")
            assert "not valid JSON" in error["message"] and error["event_id"] is None
            error = await s.error_for({"type": "session.nonsense", "event_id": "e1"})
            assert error["param"] == "type" and error["event_id"] == "e1" and error["code"] == "unknown_event"
            truncate = {"type": "conversation.item.truncate", "event_id": "e2", "item_id": "x", "audio_end_ms": 0}
            error = await s.error_for(truncate)
            assert error["param"] == "content_index" and "required" in error["message"] and error["event_id"] == "e2"
            error = await s.error_for({"type": "input_audio_buffer.append", "event_id": "e3", "audio": "@@no"})
            assert error["param"] == "audio" and "base64" in error["message"] and error["event_id"] == "e3"
            wav_event = {"type": "input_audio_buffer.append", "event_id": "e4", "audio": b64(wav.getvalue())}
            error = await s.error_for(wav_event)
            assert error["param"] == "audio" and "wav" in error["message"] and "audio/pcm" in error["message"]
            error = await s.error_for({"type": "input_audio_buffer.append", "audio": b64(b"\x01\x02\x03")})
            assert error["param"] == "audio" and "odd number of bytes" in error["message"]
            # One event over max_event_bytes (15 MiB), under the websocket's own 16 MiB frame limit.
            big = {"type": "input_audio_buffer.append", "event_id": "e5", "audio": "A" * (15 << 20)}
            error = await s.error_for(big)
            assert error["code"] == "event_too_large", error
            # More audio at once than the audio budget's burst (30 s; the buffer's own 120 s bound:
            # tests/test_realtime_limits.py). Manual turns: no VAD.
            await s.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
            assert (await s.until("session.updated"))[-1]["session"]["audio"]["input"]["turn_detection"] is None
            over = {"type": "input_audio_buffer.append", "event_id": "e6", "audio": b64(silence(31_000))}
            error = await s.error_for(over)
            assert error["code"] == "audio_rate_exceeded" and error["event_id"] == "e6", error
            await s.send({"type": "input_audio_buffer.clear"})
            await s.until("input_audio_buffer.cleared")
            # A second response while one runs.
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
            await s.send({"type": "conversation.item.create", "item": item})
            await s.send({"type": "response.create", "response": {"stage_sampling": LONG_TALK}})
            response_id = (await s.until("response.created"))[-1]["response"]["id"]
            error = await s.error_for({"type": "response.create", "event_id": "e7"})
            assert error["code"] == "conversation_already_has_active_response" and error["event_id"] == "e7"
            await s.send({"type": "response.cancel", "response_id": response_id})
            done = (await s.until("response.done"))[-1]["response"]
            assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
            error = await s.error_for({"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0,
                                       "audio_end_ms": 0, "event_id": "e8"})  # fmt: skip
            assert error["param"] == "item_id" and "item_nope" in error["message"] and error["event_id"] == "e8"
            # A flood of events: each answered, by its reply or a rate-limit error, and those taken fit
            # events_per_second (100/s, bursts of 200) at whatever speed this machine sends them. The
            # bucket's exact arithmetic, on an injected clock: tests/test_realtime_budget.py.
            started = time.monotonic()
            for _ in range(260):
                await s.send({"type": "input_audio_buffer.clear"})
            answers = [await s.recv() for _ in range(260)]
            elapsed = time.monotonic() - started
            limited = [a for a in answers if a["type"] == "error"]
            assert all(a["error"]["code"] == "rate_limit_exceeded" for a in limited), limited
            taken = len(of(answers, "input_audio_buffer.cleared"))
            assert taken + len(limited) == 260 and taken <= 200 + 100 * elapsed, (taken, elapsed)
            await asyncio.sleep(2.5)  # the bucket refills
            # Still a working session: a text reply.
            events = await s.reply("Say something.", output_modalities=["text"])
            assert events[-1]["response"]["status"] in ("completed", "incomplete"), events[-1]
            assert of(events, "response.output_text.delta") and not of(events, "response.output_audio.delta")

    asyncio.run(talk())


# ---- isolation: one session's cancel, bad event and disconnect leave another's reply intact -----------


def test_parallel_sessions_are_isolated(graph) -> None:
    import websockets

    seeded = {"seed": 11}

    async def reply() -> tuple[str, bytes]:
        async with websockets.connect(realtime_url(graph), max_size=None) as ws:
            s = Raw(ws)
            await s.until("session.created")
            events = await s.reply("Tell me about the sea.", **seeded)
            assert events[-1]["response"]["status"] in ("completed", "incomplete"), events[-1]
            text = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
            audio = b"".join(base64.b64decode(e["delta"]) for e in of(events, "response.output_audio.delta"))
            return text, audio

    async def disruptive() -> None:
        async with websockets.connect(realtime_url(graph), max_size=None) as ws:
            s = Raw(ws)
            await s.until("session.created")
            await s.error_for("][")
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}
            await s.send({"type": "conversation.item.create", "item": item})
            await s.send({"type": "response.create", "response": {"stage_sampling": LONG_TALK}})
            await s.until("response.output_audio.delta")
            await s.send({"type": "response.cancel"})
            await s.until("response.done")
            await s.send({"type": "response.create", "response": {"stage_sampling": LONG_TALK}})
            await s.until("response.output_audio.delta")
        # ... and left mid-response.

    async def both() -> tuple[tuple[str, bytes], tuple[str, bytes]]:
        alone = await reply()
        together, _ = await asyncio.gather(reply(), disruptive())
        return alone, together

    alone, together = asyncio.run(both())
    assert alone[0] and alone[1]
    assert together == alone, "a parallel session changed this session's reply"
    wait_until(lambda: idle(graph), 90, "every stage to drop the disconnected session's response")
