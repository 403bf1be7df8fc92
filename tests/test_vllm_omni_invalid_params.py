"""vLLM-Omni's own bad-input suite, ported request for request: each case gets a 4xx naming its field.

The cases are vLLM-Omni's ``tests/dfx/reliability/invalid_param_test/`` (and ``http_invalid/``) for the routes
omni_serve has, written as data: the same bodies on the same routes, each with the status vLLM-Omni expects
(a 4xx; where omni_serve answers another 4xx for the same fault, e.g. 404 for a model it does not serve, the
case says so) and the fields one of which the error must name (its ``param`` or its message). A field
omni_serve does not have is refused with a 400 naming it, never dropped. Cases for routes omni_serve does not
have are listed in docs/api.md ("vLLM-Omni's bad-input suite") with what omni_serve answers.

Chat, speech and transcription run here against the tiny omni graph (the cluster lane's default, shared with
the modules beside it). Image generation, image editing and video run in the modules that deploy those
graphs (tests/test_images_api.py, test_images_edits.py, test_videos.py), from the tables below, so the port
deploys no graph of its own.

Speech: vLLM-Omni's cases run on Qwen3-TTS with a voice-clone body (``voice: clone``, ``language``,
``ref_audio``, ``ref_text``); a speech-to-speech graph refuses those TTS fields by name, so the cases here
send that body less them (the whole body is its own case: refused naming ``language``), each case's own
fields as vLLM-Omni sends them.
"""

from __future__ import annotations

import io
import wave
from typing import Any

import httpx
import pytest

from tests.invalid_params import JSON, Case, cases, check

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3-omni"


# ---- POST /v1/audio/speech: test_invalid_audio_speech.py (invalid_param_test/ and http_invalid/) ----------

REF_TEXT = "Okay. Yeah. I resent you. I love you. I respect you. But you know what? You blew it! And thanks to you."
SILENT_WAV_URL = "data:audio/wav;base64,UklGRiQAAABXQVZFZm10IBAAAAABAAEARKwAAIhYAQACABAAZGF0YQAAAAA="
SPEECH_BASE = {"model": MODEL, "input": "Hello.", "response_format": "wav"}
CLONE = {"voice": "clone", "language": "English", "ref_audio": SILENT_WAV_URL, "ref_text": REF_TEXT}


def speech(**overrides: Any) -> dict[str, Any]:
    return {"json": {**SPEECH_BASE, **overrides}}


SPEECH_CASES = (
    Case("malformed_json", {"content": b"{", "headers": JSON}, 400, ("JSON",)),
    Case("missing_required_fields", {"json": {"model": MODEL}}, 400, ("input",)),
    Case("voice_clone_body", speech(**CLONE), 400, ("language",)),  # vLLM-Omni's base body: a TTS model's fields
    Case("input_empty", speech(input=""), 400, ("input",)),
    Case("input_whitespace_only", speech(input="   "), 400, ("input",)),
    Case("voice_empty", speech(voice=""), 400, ("voice",)),
    Case(
        "voice_unknown_preset",
        speech(voice="nonexistent_voice_xyz", task_type="CustomVoice", ref_audio=None, ref_text=None),
        400,
        ("voice", "task_type"),
    ),
    Case("instructions_wrong_type", speech(instructions=123), 400, ("instructions",)),
    Case("response_format_invalid", speech(response_format="mpeg"), 400, ("response_format",)),
    Case("stream_format_wrong_type", speech(stream_format=1), 400, ("stream_format",)),
    Case("stream_format_sse_blocked", speech(stream_format="sse"), 400, ("stream_format",)),
    Case("stream_wrong_type", speech(stream="wrong_type"), 400, ("stream",)),
    Case(
        "customvoice_task_not_supported",
        speech(voice="vivian", task_type="CustomVoice", ref_audio=None, ref_text=None),
        400,
        ("task_type", "voice"),
    ),
    Case("task_type_invalid", speech(task_type="InvalidEnum"), 400, ("task_type",)),
    Case("language_empty", speech(language=""), 400, ("language",)),
    Case("ref_audio_bad_scheme", speech(ref_audio="ftp://example.com/a.wav"), 400, ("ref_audio",)),
    Case("ref_audio_invalid_uri", speech(ref_audio="not_a_valid_uri"), 400, ("ref_audio",)),
    Case("ref_text_wrong_type", speech(ref_text=["x"]), 400, ("ref_text",)),
    Case("x_vector_only_mode_string_not_boolean", speech(x_vector_only_mode="wrong"), 400, ("x_vector_only_mode",)),
    Case(
        "speaker_embedding_with_ref_audio_mutually_exclusive",
        speech(speaker_embedding=[0.01] * 1024, ref_audio=SILENT_WAV_URL, ref_text=REF_TEXT),
        400,
        ("speaker_embedding",),
    ),
    Case("max_new_tokens_below_min", speech(max_new_tokens=0), 400, ("max_new_tokens",)),
    Case("max_new_tokens_above_max", speech(max_new_tokens=4097), 400, ("max_new_tokens",)),
    Case("seed_negative", speech(seed=-1), 400, ("seed",)),
    Case("seed_above_max", speech(seed=2**63), 400, ("seed",)),
    Case("initial_codec_chunk_frames_negative", speech(initial_codec_chunk_frames=-1), 400, ("initial_codec",)),
    Case("instructions_exceed_api_limit", speech(instructions="x" * 501), 400, ("instructions",)),
    Case(
        "ref_text_whitespace_only_base_clone",
        speech(task_type="Base", ref_audio=SILENT_WAV_URL, ref_text="   "),
        400,
        ("ref_text", "task_type"),
    ),
    Case("base_speaker_embedding_empty", speech(task_type="Base", speaker_embedding=[]), 400, ("speaker_embedding",)),
    Case(
        "base_speaker_embedding_wrong_dim_short",
        speech(task_type="Base", x_vector_only_mode=True, speaker_embedding=[0.01] * 512),
        400,
        ("speaker_embedding",),
    ),
    Case(
        "base_speaker_embedding_wrong_dim_long",
        speech(task_type="Base", x_vector_only_mode=True, speaker_embedding=[0.01] * 2048),
        400,
        ("speaker_embedding",),
    ),
    # Higgs Audio V3's cases (same route; its base body is only model + these fields).
    Case("higgs_input_empty", {"json": {"model": MODEL, "input": "", "response_format": "wav"}}, 400, ("input",)),
    Case("higgs_input_whitespace_only", {"json": {"model": MODEL, "input": "   "}}, 400, ("input",)),
    Case("higgs_max_new_tokens_below_min", speech(input="Hello world.", max_new_tokens=0), 400, ("max_new_tokens",)),
    Case(
        "higgs_multi_reference_payload",
        speech(references=[{"audio_path": SILENT_WAV_URL, "text": REF_TEXT}] * 2),
        400,
        ("references",),
    ),
    Case("higgs_references_empty_array", speech(references=[]), 400, ("references",)),
    Case("higgs_references_missing_audio_path", speech(references=[{"text": REF_TEXT}]), 400, ("references",)),
    Case("higgs_references_bad_element_type", speech(references=[1]), 400, ("references",)),
    Case(
        "higgs_ref_audio_and_references_exclusive",
        speech(ref_audio=SILENT_WAV_URL, references=[{"audio_path": "https://example.com/other.wav"}]),
        400,
        ("references", "ref_audio"),
    ),
    Case(
        "higgs_references_text_conflicts_ref_text",
        speech(ref_text="different transcript", references=[{"audio_path": SILENT_WAV_URL, "text": REF_TEXT}]),
        400,
        ("references", "ref_text"),
    ),
)


@cases(*SPEECH_CASES)
def test_speech(tiny_omni, case: Case) -> None:
    check(tiny_omni.base_url, "/v1/audio/speech", case)


# ---- POST /v1/chat/completions: test_invalid_omni_chat.py ----------------------------------------------

CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": False}


def chat(**overrides: Any) -> dict[str, Any]:
    return {"json": {**CHAT_BASE, **overrides}}


CHAT_CASES = (
    Case("malformed_json", {"content": b"{not-json", "headers": JSON}, 400, ("JSON",)),
    Case("missing_messages", {"json": {"model": MODEL, "stream": False}}, 400, ("messages",)),
    Case("model_mismatch", chat(model="this-model-is-not-served-on-this-instance"), 404, ("model",)),
    Case("invalid_stream_type", chat(stream="not-a-boolean"), 400, ("stream",)),
    Case("invalid_temperature_type", chat(temperature="hot"), 400, ("temperature",)),
    Case("invalid_max_tokens_type", chat(max_tokens="not-an-int"), 400, ("max_tokens",)),
    Case("modalities_scalar", chat(modalities="text"), 400, ("modalities",)),
    Case("modalities_list_bad_element", chat(modalities=[123]), 400, ("modalities",)),
    Case("invalid_response_format_json_schema", chat(response_format={"type": "json_schema"}), 400, ("json_schema",)),
    Case("logprobs_wrong_type", chat(logprobs="yes"), 400, ("logprobs",)),
    Case("logprobs_top_without_logprobs_true", chat(logprobs=False, top_logprobs=5), 400, ("top_logprobs",)),
    Case("speaker_unknown_preset", chat(speaker="zz_invalid_qwen3_omni_chat_speaker_xyz"), 400, ("speaker",)),
)


@cases(*CHAT_CASES)
def test_chat(tiny_omni, case: Case) -> None:
    check(tiny_omni.base_url, "/v1/chat/completions", case)


# ---- POST /v1/audio/transcriptions: test_invalid_audio_transcription.py ---------------------------------


def silent_wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(b"\x00\x00" * int(seconds * rate))
    return out.getvalue()


def transcription(file: bytes, name: str = "speech.wav", **form: str) -> dict[str, Any]:
    fields = {"model": MODEL, "language": "en", "response_format": "text", "temperature": "0.0", **form}
    return {"files": {"file": (name, file, "audio/wav")}, "data": fields}


TRANSCRIPTION_CASES = (
    Case("invalid_language", transcription(silent_wav(), language="hh"), 400, ("language",)),
    Case("invalid_audio", transcription(b"not a valid audio file", "invalid.wav"), 400, ("file",)),
    # vLLM-Omni's: a model that does no ASR (it serves llama-68m there); here: a model this server does not serve.
    Case("model_not_found", transcription(silent_wav(), model="JackFram/llama-68m"), 404, ("model",)),
    # omni_serve's own, in the suite's spirit: nothing of a form is silently dropped.
    Case(
        "unknown_file_field",
        {"files": {"file": ("a.wav", silent_wav(), "audio/wav"), "extra": ("b.wav", silent_wav(), "audio/wav")}},
        400,
        ("extra",),
    ),
    Case("unknown_form_field", transcription(silent_wav(), timestamp_offset="3"), 400, ("timestamp_offset",)),
)


@cases(*TRANSCRIPTION_CASES)
def test_transcription(tiny_omni, case: Case) -> None:
    check(tiny_omni.base_url, "/v1/audio/transcriptions", case)


# ---- vLLM-Omni's routes omni_serve does not have: what it answers (docs/api.md lists each with its case file) --

NOT_HERE = (
    ("POST", "/v1/audio/speech/batch", 404),  # test_invalid_audio_speech.py: batch speech
    ("POST", "/v1/audio/voices", 405),  # voice upload (GET lists the graph's voices)
    ("DELETE", "/v1/audio/voices/clone", 404),
    ("POST", "/v1/audio/translations", 404),  # test_invalid_audio_translation.py
    ("POST", "/v1/omni/sleep", 404),  # test_invalid_server_control.py
    ("POST", "/v1/omni/wakeup", 404),
    ("POST", "/v1/videos/sync", 405),  # test_invalid_video_generation.py: /v1/videos/{id} answers GET and DELETE
)


@pytest.mark.parametrize(("method", "route", "status"), NOT_HERE, ids=[f"{m} {r}" for m, r, _ in NOT_HERE])
def test_routes_omni_serve_does_not_have(tiny_omni, method: str, route: str, status: int) -> None:
    reply = httpx.request(method, f"{tiny_omni.base_url}{route}", json={"model": MODEL}, timeout=60)
    assert reply.status_code == status, reply.text[:300]
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


# ---- POST /v1/images/generations: test_invalid_image_generation.py (run by tests/test_images_api.py) ------


# ---- POST /v1/images/edits: test_invalid_image_editing.py and _cpu.py (run by tests/test_images_edits.py) --


# ---- POST /v1/videos and the job routes: test_invalid_video_generation.py (run by tests/test_videos.py) ----
