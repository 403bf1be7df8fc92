"""The properties every served TTS family holds on ``/v1/audio/speech``, as checks its integration module runs on
its deployed graph (as :mod:`tests.graph_properties` does for every graph): a new TTS family is one
:class:`Speaker` in :data:`SPEAKERS` and one parametrized test.

Each reply is decoded by an independent decoder (:mod:`tests.audio`: libsndfile, PyAV for the compressed formats)
and must be whole codec frames of finite, non-silent audio at the family's rate:

- the models card says a TTS graph: audio out, the speech route and no chat route, its stages and voices;
- the same request gives the same samples; another voice or other text gives other audio;
- a streamed reply (``stream: true``) is the whole reply's samples, in pieces;
- every compressed format it declares decodes;
- what the model refuses is a 400 naming the field, and chat is refused saying which route to use;
- ``max_new_tokens`` caps the entry stage: ``X-Finish-Reason: length`` and the frames the cap allows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests import audio

TEXT = "Hello from the tiny talker."
OTHER_TEXT = "Other words."


@dataclass(frozen=True)
class Speaker:
    """What a TTS family's checks need to know of it."""

    family: str  # its name in tests.families
    model: str
    stages: tuple[str, ...]
    voices: tuple[str, ...]  # the voices its card lists, in order
    voice: str  # the voice of its plain request
    other_voice: str
    formats: tuple[str, ...]  # the compressed formats it is asked for
    refused: tuple[tuple[dict[str, Any], str], ...]  # (fields, the param its 400 names)
    capped: tuple[dict[str, Any], int]  # (fields with a max_new_tokens, the whole frames the reply holds)
    # Requests (beside the plain one's fields) whose reply may end on its own (``X-Finish-Reason: stop``): which
    # do can depend on the machine's arithmetic (a random-weight greedy model), and a reply that runs to its cap
    # cannot be the one streamed (a started stream reports that as an error).
    ending: tuple[dict[str, Any], ...]
    fields: dict[str, Any] = field(default_factory=dict)  # sent with every request (a seed)
    rate: int = 24000
    samples_per_frame: int = 1920  # a 12.5 Hz codec at 24 kHz


def speech(graph: Any, speaker: Speaker, **fields: Any) -> httpx.Response:
    body = {"model": speaker.model, "input": TEXT, "response_format": "wav", **speaker.fields, **fields}
    return httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=300)


def samples(graph: Any, speaker: Speaker, **fields: Any) -> np.ndarray:
    """One reply, decoded: whole codec frames of finite, non-silent audio at the family's rate."""
    reply = speech(graph, speaker, **fields)
    assert reply.status_code == 200, reply.text[:500]
    fmt = fields.get("response_format", "wav")
    return audio.speech_frames(reply.content, fmt, speaker.rate, speaker.samples_per_frame)


def differ(a: np.ndarray, b: np.ndarray) -> bool:
    return a.size != b.size or not np.array_equal(a, b)


def models_card_says_a_tts_graph(graph: Any, speaker: Speaker) -> None:
    (card,) = httpx.get(f"{graph.base_url}/v1/models", timeout=30).json()["data"]
    assert card["id"] == speaker.model and card["modalities"] == ["audio"]
    assert "/v1/audio/speech" in card["routes"] and "/v1/chat/completions" not in card["routes"]
    assert card["stages"] == list(speaker.stages) and card["voices"] == list(speaker.voices)


def same_request_same_samples(graph: Any, speaker: Speaker) -> None:
    first = samples(graph, speaker, voice=speaker.voice, response_format="pcm")
    again = samples(graph, speaker, voice=speaker.voice, response_format="pcm")
    assert np.array_equal(first, again), "the same request gave other samples"


def voice_and_text_matter(graph: Any, speaker: Speaker) -> None:
    base = samples(graph, speaker, voice=speaker.voice)
    for other in (
        samples(graph, speaker, voice=speaker.other_voice),
        samples(graph, speaker, voice=speaker.voice, input=OTHER_TEXT),
    ):
        assert differ(other, base)


def streamed_pcm_is_the_whole_reply_in_pieces(graph: Any, speaker: Speaker) -> None:
    """The first of the family's ``ending`` requests whose whole reply ends on its own, streamed."""
    ends = []
    for fields in speaker.ending:
        reply = speech(graph, speaker, **fields, response_format="pcm")
        assert reply.status_code == 200, reply.text[:500]
        ends.append(reply.headers["x-finish-reason"])
        if ends[-1] == "stop":
            break
    else:
        pytest.fail(f"no request of {speaker.family}'s ending ends on its own here ({ends}): add one that does")
    whole = audio.speech_frames(reply.content, "pcm", speaker.rate, speaker.samples_per_frame)
    body = {"model": speaker.model, "input": TEXT, **speaker.fields, **fields, "response_format": "pcm", "stream": True}
    pieces: list[bytes] = []
    with httpx.stream("POST", f"{graph.base_url}/v1/audio/speech", json=body, timeout=300) as streamed_reply:
        assert streamed_reply.status_code == 200
        pieces.extend(streamed_reply.iter_bytes())
    streamed, _ = audio.decode("pcm", b"".join(pieces), speaker.rate)
    assert streamed.size == whole.size and np.abs(streamed - whole).max() <= 1 / 32768


def every_compressed_format_decodes(graph: Any, speaker: Speaker) -> None:
    for fmt in speaker.formats:
        reply = speech(graph, speaker, voice=speaker.voice, response_format=fmt)
        assert reply.status_code == 200, (fmt, reply.text[:500])
        decoded, rate = audio.decode(fmt, reply.content, speaker.rate)
        assert rate in (24000, 48000) and decoded.size > 0 and np.abs(decoded).max() > 1e-3, fmt


def what_is_refused_is_a_400_naming_the_field(graph: Any, speaker: Speaker) -> None:
    for fields, param in speaker.refused:
        reply = speech(graph, speaker, **fields)
        assert reply.status_code == 400, (fields, reply.text[:300])
        assert reply.json()["error"]["param"] == param, fields


def chat_is_refused_saying_why(graph: Any, speaker: Speaker) -> None:
    client = openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=speaker.model, messages=[{"role": "user", "content": "Hi"}])
    assert "/v1/audio/speech" in str(err.value) and "text to speak" in str(err.value)


def max_new_tokens_caps_the_frames(graph: Any, speaker: Speaker) -> None:
    fields, frames = speaker.capped
    capped = speech(graph, speaker, **fields, response_format="pcm")
    assert capped.status_code == 200 and capped.headers["x-finish-reason"] == "length", capped.text[:300]
    assert audio.decode("pcm", capped.content, speaker.rate)[0].size == frames * speaker.samples_per_frame


PROPERTIES: tuple[Callable[[Any, Speaker], None], ...] = (
    models_card_says_a_tts_graph,
    same_request_same_samples,
    voice_and_text_matter,
    streamed_pcm_is_the_whole_reply_in_pieces,
    every_compressed_format_decodes,
    what_is_refused_is_a_400_naming_the_field,
    chat_is_refused_saying_why,
    max_new_tokens_caps_the_frames,
)

# Refused by every TTS family: a voice it does not have, and more new tokens than its entry stage allows.
NOBODY = ({"voice": "nobody"}, "voice")

SPEAKERS = {
    speaker.family: speaker
    for speaker in (
        Speaker(
            family="vllm_omni.qwen3_tts",
            model="tiny-qwen3-tts",
            stages=("qwen3_tts", "code2wav"),
            voices=("ryan", "vivian"),
            voice="vivian",
            other_voice="ryan",
            formats=("mp3", "flac", "opus", "aac"),
            refused=(
                NOBODY,
                ({"task_type": "VoiceDesign"}, "instructions"),
                ({"task_type": "Base", "ref_text": "A short reference."}, "ref_audio"),
                ({"language": "klingon"}, "language"),
                ({"ref_audio": "http://127.0.0.1:1/a.wav"}, "ref_audio"),
                ({"max_new_tokens": 5000}, "max_new_tokens"),
            ),
            # A frame's residual code groups come with the talker's next step, so a reply cut at N tokens holds
            # N - 1 whole frames (no step runs past the last token); min_tokens keeps it from ending sooner.
            capped=({"voice": "vivian", "max_new_tokens": 3, "stage_sampling": {"qwen3_tts": {"min_tokens": 3}}}, 2),
            ending=({"voice": "vivian"}, {"voice": "ryan"}, {"voice": "vivian", "input": OTHER_TEXT}),
            fields={"seed": 7},
        ),
        Speaker(
            family="vllm_omni.voxtral_tts",
            model="tiny-voxtral-tts",
            stages=("audio_generation", "audio_tokenizer"),
            voices=("casual_male", "neutral_female"),
            voice="casual_male",
            other_voice="neutral_female",
            formats=("mp3", "flac"),
            refused=(NOBODY, ({"voice": "casual_male", "max_new_tokens": 5000}, "max_new_tokens")),
            capped=({"voice": "neutral_female", "max_new_tokens": 10}, 10),
            # Seen ending: casual_male on TEXT (24 frames, one machine); neutral_female on "Other words." (16) and
            # "Hello." (4, another).
            ending=(
                {"voice": "casual_male"},
                {"voice": "neutral_female", "input": OTHER_TEXT},
                {"voice": "neutral_female", "input": "Hello."},
                {"voice": "casual_male", "input": "Yes."},
            ),
        ),
    )
}
