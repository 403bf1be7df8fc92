"""Media in chat requests: cheap checks at the ingress, fetching and decoding in the entry stage.

The ingress (:func:`data_url_bytes`, :func:`sniff`) only looks at what it must to refuse a bad
request early: base64 that does not decode, more bytes than ``max_bytes``, bytes whose magic numbers
are not a format this kind of part accepts. It never decodes pixels or samples; the bytes go on to
the entry stage through the object store.

The entry stage (:func:`load_media`) fetches URLs under :mod:`omni_serve.media.policy`, sniffs the
bytes (headers are never trusted), and decodes them with FFmpeg (PyAV) and Pillow, in a worker thread,
so the work scales with the entry stage's replicas:

- images: Pillow, only the decoder of the sniffed format; the dimensions are read from the header and
  checked against ``max_image_pixels`` before any pixel is decoded (decompression bombs). First frame
  of an animation; RGB.
- audio: FFmpeg with the demuxer forced to the sniffed format (FFmpeg never probes, so no playlist or
  concat demuxer can open other files or URLs), resampled to mono float32 at the rate the model's
  feature extractor expects; refused as soon as the decoded length passes ``max_audio_seconds``.
- video: frames sampled at ``video_fps`` (RGB, the first frame at or after each sampling time),
  refused when a frame is larger than ``max_image_pixels``, the video longer than
  ``max_video_seconds`` or the samples more than ``max_video_frames``; with ``use_audio_in_video``
  its audio track too, like an audio part.

Every refusal names the content part (``messages.<i>.content.<j>``): 400, or 413 over ``max_bytes``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omni_serve.exceptions import InvalidStageInput
from omni_serve.media.policy import MediaPolicy, fetch

MediaKind = Literal["image", "audio", "video"]


class MediaInputConfig(BaseModel):
    """Graph arg ``media_input``: per-request limits on media parts and how video is sampled."""

    model_config = ConfigDict(extra="forbid")

    max_parts: int = Field(8, ge=0, description="Media parts per request (all turns together).")
    max_bytes: int = Field(8 << 20, ge=1, description="Encoded bytes of one media item (413 above).")
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, description="Width x height of an image or video frame, checked before decoding."
    )
    max_audio_seconds: float = Field(300.0, gt=0, description="Length of one audio item.")
    max_video_seconds: float = Field(120.0, gt=0, description="Length of one video.")
    max_video_frames: int = Field(64, ge=1, description="Frames one video may give the model (at video_fps).")
    video_fps: float = Field(2.0, gt=0, le=60, description="Video frames sampled per second of video.")


# --- the bytes: magic numbers, data URLs ----------------------------------------------------------

# Formats each kind of part accepts, by sniffed container.
FORMATS: dict[str, frozenset[str]] = {
    "image": frozenset({"png", "jpeg", "gif", "webp", "bmp"}),
    "audio": frozenset({"wav", "flac", "ogg", "mp3", "aac", "mp4", "webm"}),
    "video": frozenset({"mp4", "webm"}),
}
# input_audio's declared format -> the container it must sniff as.
DECLARED_AUDIO = {
    "wav": "wav",
    "mp3": "mp3",
    "flac": "flac",
    "ogg": "ogg",
    "opus": "ogg",
    "aac": "aac",
    "m4a": "mp4",
    "webm": "webm",
}
# FFmpeg demuxer forced for each sniffed container; Pillow decoder for each image format.
_DEMUXERS = {"wav": "wav", "flac": "flac", "ogg": "ogg", "mp3": "mp3", "aac": "aac", "mp4": "mp4", "webm": "matroska"}
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "gif": "GIF", "webp": "WEBP", "bmp": "BMP"}


def sniff(data: bytes) -> str | None:
    """The container format from the first bytes (magic numbers), or None."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "webp"
    if head.startswith(b"RIFF") and head[8:12] == b"WAVE":
        return "wav"
    if head.startswith(b"BM") and len(data) > 26:
        return "bmp"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"OggS"):
        return "ogg"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "webm"
    if head.startswith(b"ID3"):
        return "mp3"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:  # ADTS sync, layer 00
        return "aac"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06:  # MPEG audio frame
        return "mp3"
    return None


def _refused(param: str, message: str, status: int = 400) -> InvalidStageInput:
    return InvalidStageInput(f"{param}: {message}", param, status=status)


def check_format(data: bytes, kind: str, param: str, declared: str | None = None) -> str:
    """The sniffed format of ``data`` if a ``kind`` part accepts it (and it is what ``declared`` says)."""
    if not data:
        raise _refused(param, f"the {kind} is empty (0 bytes)")
    fmt = sniff(data)
    if fmt not in FORMATS[kind]:
        found = f"{fmt} data" if fmt else "no known format (magic bytes)"
        raise _refused(param, f"expected {kind} data ({', '.join(sorted(FORMATS[kind]))}), found {found}")
    if declared is not None and DECLARED_AUDIO[declared] != fmt:
        raise _refused(param, f"format is '{declared}' but the data is {fmt}")
    return fmt


def base64_bytes(text: str, param: str, max_bytes: int) -> bytes:
    """Strictly decoded base64 (no stray characters, correct padding), at most ``max_bytes``."""
    if len(text) // 4 * 3 > max_bytes + 2:  # refused before decoding anything
        raise _refused(param, f"media over the limit of {max_bytes} bytes", 413)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(param, "invalid base64 data") from None
    if len(data) > max_bytes:
        raise _refused(param, f"media over the limit of {max_bytes} bytes", 413)
    return data


def data_url_bytes(url: str, param: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:[<media type>];base64,<data>`` URL. The declared media type is not trusted."""
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().startswith("data:"):
        raise _refused(param, "malformed data URL (expected data:<media type>;base64,<data>)")
    if not header.lower().endswith(";base64"):
        raise _refused(param, "data URLs must be base64-encoded (data:<media type>;base64,<data>)")
    return base64_bytes(payload, param, max_bytes)


# --- decoding (entry stage) -------------------------------------------------------------------


@dataclass
class Image:
    pixels: np.ndarray  # uint8 [H, W, 3]


@dataclass
class Audio:
    samples: np.ndarray  # float32 mono at the model's rate


@dataclass
class Video:
    frames: np.ndarray  # uint8 [T, H, W, 3], sampled at ``fps``
    fps: float
    audio: np.ndarray | None = None  # its audio track (float32 mono at the model's rate), when it is input too


Decoded = Image | Audio | Video


def decode_image(data: bytes, fmt: str, param: str, config: MediaInputConfig) -> Image:
    from PIL import Image as PILImage

    with warnings.catch_warnings():
        warnings.simplefilter("error", PILImage.DecompressionBombWarning)
        try:
            image = PILImage.open(io.BytesIO(data), formats=[_PIL_FORMATS[fmt]])  # reads the header only
        except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning) as err:
            raise _refused(param, f"image over the pixel limit ({err})") from None
        except Exception as err:  # any decoder error: the bytes are not a valid image of that format
            raise _refused(param, f"not a valid {fmt} image ({type(err).__name__})") from None
        width, height = image.size
        if width * height > config.max_image_pixels:
            raise _refused(param, f"image of {width}x{height} pixels is over the limit of {config.max_image_pixels}")
        try:
            pixels = np.array(image.convert("RGB"))  # the first frame of an animation (a writable copy)
        except Exception as err:
            raise _refused(param, f"not a valid {fmt} image ({type(err).__name__})") from None
    if pixels.size == 0:
        raise _refused(param, "the image has no pixels")
    return Image(pixels)


def _open_container(data: bytes, fmt: str, param: str) -> Any:
    import av

    try:
        return av.open(io.BytesIO(data), format=_DEMUXERS[fmt])  # forced demuxer: FFmpeg never probes
    except Exception as err:
        raise _refused(param, f"not a valid {fmt} file ({type(err).__name__})") from None


def audio_seconds(data: bytes, fmt: str, param: str) -> float | None:
    """The audio's length from its container's header (no samples decoded), or None when it does not say."""
    with _open_container(data, fmt, param) as container:
        return None if container.duration is None else container.duration / 1e6


def _decode_track(container: Any, stream: Any, rate: int, max_seconds: float, param: str, what: str) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    cap = int(max_seconds * rate)
    chunks: list[np.ndarray] = []
    size = 0
    try:
        for frame in container.decode(stream):
            frame.pts = None  # the resampler keeps its own clock; broken timestamps cannot stall it
            for out in resampler.resample(frame):
                samples = out.to_ndarray().reshape(-1)
                size += samples.size
                if size > cap:
                    raise _refused(param, f"{what} longer than the limit of {max_seconds:g} s")
                chunks.append(samples)
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    except InvalidStageInput:
        raise
    except Exception as err:
        raise _refused(param, f"{what} could not be decoded ({type(err).__name__})") from None
    samples = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise _refused(param, f"{what} has no samples")
    return samples


def _check_duration(container: Any, max_seconds: float, param: str, what: str) -> None:
    if container.duration is not None and container.duration / 1e6 > max_seconds:
        raise _refused(
            param, f"{what} of {container.duration / 1e6:.1f} s is longer than the limit of {max_seconds:g} s"
        )


def decode_audio(data: bytes, fmt: str, rate: int, param: str, config: MediaInputConfig) -> Audio:
    with _open_container(data, fmt, param) as container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            raise _refused(param, "no audio stream")
        _check_duration(container, config.max_audio_seconds, param, "audio")
        return Audio(_decode_track(container, stream, rate, config.max_audio_seconds, param, "audio"))


def decode_video(data: bytes, fmt: str, rate: int, with_audio: bool, param: str, config: MediaInputConfig) -> Video:
    limit = config.max_video_seconds
    with _open_container(data, fmt, param) as container:
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None:
            raise _refused(param, "no video stream")
        _check_duration(container, limit, param, "video")
        frames = _sample_frames(container, stream, param, config)
    audio = None
    if with_audio:  # a second pass over the same bytes: the audio track only
        with _open_container(data, fmt, param) as container:
            track = next((s for s in container.streams if s.type == "audio"), None)
            if track is None:
                raise _refused(param, "the video has no audio track (mm_processor_kwargs.use_audio_in_video)")
            audio = _decode_track(container, track, rate, limit, param, "the video's audio track")
    return Video(frames, config.video_fps, audio)


def _sample_frames(container: Any, stream: Any, param: str, config: MediaInputConfig) -> np.ndarray:
    context = stream.codec_context
    if context.width * context.height > config.max_image_pixels:
        raise _refused(
            param, f"video of {context.width}x{context.height} pixels is over the limit of {config.max_image_pixels}"
        )
    step = 1.0 / config.video_fps
    frames: list[np.ndarray] = []
    next_time = 0.0
    try:
        for index, frame in enumerate(container.decode(stream)):
            if frame.width * frame.height > config.max_image_pixels:
                raise _refused(param, f"video frame of {frame.width}x{frame.height} pixels is over the limit")
            time = frame.time if frame.time is not None else index / float(stream.average_rate or 1)
            if time > config.max_video_seconds:
                raise _refused(param, f"video longer than the limit of {config.max_video_seconds:g} s")
            if time + 1e-6 < next_time:
                continue
            if len(frames) == config.max_video_frames:
                raise _refused(
                    param,
                    f"video gives more than {config.max_video_frames} frames at "
                    f"{config.video_fps:g} fps (max_video_frames)",
                )
            pixels = frame.to_ndarray(format="rgb24")
            if frames and pixels.shape != frames[0].shape:
                raise _refused(param, "video frames change size")
            frames.append(pixels)
            while next_time <= time + 1e-6:
                next_time += step
    except InvalidStageInput:
        raise
    except Exception as err:
        raise _refused(param, f"video could not be decoded ({type(err).__name__})") from None
    if not frames:
        raise _refused(param, "the video has no frames")
    return np.stack(frames)


# Evidence for the invariant "the ingress never decodes media": decodes, per kind, in this process.
_decodes: Counter[str] = Counter()


def decodes() -> dict[str, int]:
    """How many media items of each kind this process decoded (tests read the ingress's and the stages')."""
    return dict(_decodes)


def decode(
    kind: str, data: bytes, param: str, config: MediaInputConfig, audio_rate: int, audio_in_video: bool = False
) -> Decoded:
    """Sniff and decode one item (blocking: run it in a thread)."""
    _decodes[kind] += 1
    fmt = check_format(data, kind, param)
    if kind == "image":
        return decode_image(data, fmt, param, config)
    if kind == "audio":
        return decode_audio(data, fmt, audio_rate, param, config)
    return decode_video(data, fmt, audio_rate, audio_in_video, param, config)


async def load_media(
    parts: Sequence[Any], policy: MediaPolicy, config: MediaInputConfig, audio_rate: int
) -> list[Decoded]:
    """Fetch (a URL, under the policy) and decode every media part, concurrently, in order.

    ``parts`` are :class:`omni_serve.types.MediaPart`: ``data`` the encoded item's bytes (already out
    of the object store: :func:`omni_serve.graph.transport.receive`), or ``url`` to fetch.
    """

    async def one(part: Any) -> Decoded:
        if part.url is not None:
            data = await fetch(part.url, part.param, policy, config.max_bytes)
        else:
            data = part.data
        return await asyncio.to_thread(decode, part.type, data, part.param, config, audio_rate, part.audio_in_video)

    return list(await asyncio.gather(*(one(part) for part in parts)))
