"""A stage cut short at its ``max_tokens`` is reported on every route, against the deployed tiny graph.

The thinker is made to stop by itself (greedy, and a stop string taken from its own greedy reply), the
talker to run out (greedy: the tiny talker then never samples its codec EOS), so "length" can only
come from the talker: chat says ``finish_reason: "length"`` (streamed and not; its stage metrics show
which stage), a realtime response ends ``incomplete``; the same requests without the talker say
``stop`` / ``completed``. Speech (whose talker sampling is the graph's) says in ``X-Finish-Reason``,
decided at the talker's end, whether its talker ran out; transcriptions say how the thinker ended in
every format. In process, over fake stages: tests/test_truncation.py.
"""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from omni_serve.api.openai.chat import FINISH_REASON_HEADER
from tests.conftest import one_replica_per_stage
from tests.realtime_client import Raw, of, realtime_url
from tests.tiny_config import tiny_args

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3-omni"
HELLO = [{"role": "user", "content": "Say something about the weather."}]
GREEDY_THINKER = {"temperature": 0.0, "max_tokens": 8}
CUT_TALKER = {"temperature": 0.0, "max_tokens": 3}  # greedy: never its codec EOS, so it stops at 3 frames


@pytest.fixture(scope="module")
def graph(tiny_omni: Any) -> Any:
    return one_replica_per_stage(tiny_omni)


def chat(base_url: str, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "messages": HELLO, "seed": 5, **body}
    return httpx.post(f"{base_url}/v1/chat/completions", json=payload, timeout=120)


@pytest.fixture(scope="module")
def stop(graph: Any) -> str:
    """A stop string the greedy thinker meets within its 8 tokens: the second half of its own greedy reply."""
    reply = chat(graph.base_url, stage_sampling={"thinker": GREEDY_THINKER}).json()
    text = reply["choices"][0]["message"]["content"]
    assert text.strip(), reply
    return text[len(text) // 2 :]


def test_chat_says_length_when_the_talker_ran_out(graph: Any, stop: str) -> None:
    thinker = {**GREEDY_THINKER, "stop": [stop]}
    text_only = chat(graph.base_url, stage_sampling={"thinker": thinker}).json()
    assert text_only["choices"][0]["finish_reason"] == "stop", text_only  # the thinker stopped by itself
    spoken = {"stage_sampling": {"thinker": thinker, "talker": CUT_TALKER}, "modalities": ["text", "audio"]}
    whole = chat(graph.base_url, return_stage_metrics=True, **spoken).json()
    assert whole["choices"][0]["finish_reason"] == "length", whole["choices"][0]
    stages = {m["stage_name"]: m for m in whole["metrics"]["stage_metrics"].values()}
    assert stages["thinker"]["finish_reason"] == "stop" and stages["talker"]["finish_reason"] == "length"
    assert whole["choices"][0]["message"]["audio"]["data"]  # what was spoken is still sent
    with httpx.stream(
        "POST",
        f"{graph.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": HELLO, "seed": 5, "stream": True, **spoken},
        timeout=120,
    ) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"], finishes


def test_a_realtime_response_whose_talker_ran_out_is_incomplete(graph: Any) -> None:
    """Out-of-band responses (``conversation: "none"``) over one user turn, so each sees the same prompt."""

    async def talk() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        import websockets

        async with websockets.connect(realtime_url(graph), max_size=None) as ws:
            s = Raw(ws)
            await s.until("session.created")
            once = {"seed": 5, "conversation": "none", "output_modalities": ["text"]}
            greedy = await s.reply(HELLO[0]["content"], **once, stage_sampling={"thinker": GREEDY_THINKER})
            said = "".join(e["delta"] for e in of(greedy, "response.output_text.delta"))
            assert said.strip(), greedy[-1]
            thinker = {**GREEDY_THINKER, "stop": [said[len(said) // 2 :]]}
            await s.send({"type": "response.create", "response": {**once, "stage_sampling": {"thinker": thinker}}})
            text = await s.until("response.done")
            cut = {"thinker": thinker, "talker": CUT_TALKER}
            spoken_once = {**once, "output_modalities": ["audio"], "stage_sampling": cut}
            await s.send({"type": "response.create", "response": spoken_once})
            spoken = await s.until("response.done")
            return text[-1]["response"], spoken[-1]["response"], spoken

    text, spoken, events = asyncio.run(talk())
    assert text["status"] == "completed", text
    assert spoken["status"] == "incomplete", spoken
    assert spoken["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert of(events, "response.output_audio.delta")  # what was spoken is still sent


def test_speech_says_in_its_header_whether_its_talker_ran_out(graph: Any) -> None:
    """Speech takes the graph's talker sampling (its max_tokens frames, sampled: the tiny talker rarely samples its
    codec EOS, so most seeds run out). ``X-Finish-Reason`` says "length" exactly when the file holds the talker's
    whole max_tokens frames (its audio is frames x 1920 samples less the vocoder's lag, under one frame)."""
    (talker,) = [stage for stage in tiny_args()["stages"] if stage["name"] == "talker"]
    limit, frame = talker["default_sampling"]["max_tokens"], 1920
    said = []
    for seed in range(3):
        body = {"model": MODEL, "input": "Hello from the tiny talker.", "response_format": "pcm", "seed": seed}
        reply = httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        frames = -(-len(reply.content) // 2 // frame)  # whole frames, the last one short by the lag
        said.append((reply.headers[FINISH_REASON_HEADER], frames))
    assert all(finish == ("length" if frames == limit else "stop") for finish, frames in said), said


def test_early_speech_says_nothing_it_cannot_know_and_a_cut_breaks_its_body(graph: Any) -> None:
    """``stream: true`` sends the status with the first audio, before the talker's end: no ``X-Finish-Reason``
    then, and a reply its talker cut short ends in a broken body (never a whole file); one that stopped by
    itself is the same bytes as without ``stream``. The seeds' ends are read from the header of the same
    requests without ``stream`` (the same seed gives the same audio)."""
    ends = {"length": 0, "stop": 0}
    unsaid = 0  # replies whose status went out before the talker's end
    for seed in range(3):
        body = {"model": MODEL, "input": "Hello from the tiny talker.", "response_format": "pcm", "seed": seed}
        settled = httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=120)
        finish = settled.headers[FINISH_REASON_HEADER]
        ends[finish] += 1
        pieces: list[bytes] = []
        broken = False
        with httpx.stream("POST", f"{graph.base_url}/v1/audio/speech", json={**body, "stream": True}) as early:
            assert early.status_code == 200
            said = early.headers.get(FINISH_REASON_HEADER)  # said only where the talker had ended by then
            assert said in (None, finish), (seed, said, finish)
            unsaid += said is None
            try:
                pieces.extend(early.iter_bytes())
            except httpx.RemoteProtocolError:
                broken = True
        assert broken == (finish == "length" and said is None), (seed, finish, said)
        if not broken:
            assert b"".join(pieces) == settled.content, seed
    assert ends["length"] and unsaid, (ends, unsaid)  # the graph's sampled max_tokens frames run out for most seeds


@pytest.fixture(scope="module")
def speech_wav() -> bytes:
    from tests.audio import spoken

    samples = np.frombuffer(spoken("The quick brown fox jumps over the lazy dog."), "<i2")
    out = io.BytesIO()
    sf.write(out, samples, 24000, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_transcriptions_say_how_the_transcript_ended(graph: Any, speech_wav: bytes) -> None:
    """Every format carries the thinker's finish, and it is "length" exactly when the transcript took the
    thinker's whole max_tokens (the graph's 32: the tiny random thinker rarely samples its EOS)."""
    url = f"{graph.base_url}/v1/audio/transcriptions"
    files = {"file": ("speech.wav", speech_wav, "audio/wav")}

    def post(**form: str) -> httpx.Response:
        reply = httpx.post(url, files=files, data={"model": MODEL, **form}, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply

    plain = post().json()
    expected = "length" if plain["usage"]["output_tokens"] == 32 else "stop"
    assert plain["finish_reason"] == expected, plain
    assert post(response_format="verbose_json").json()["finish_reason"] == expected
    text = post(response_format="text")
    assert text.text == plain["text"] and text.headers[FINISH_REASON_HEADER] == expected
    events = [json.loads(line[6:]) for line in post(stream="true").text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["finish_reason"] == expected
