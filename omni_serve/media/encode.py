"""Audio, image and video encoding for API responses: FFmpeg's codecs through PyAV, and Pillow.

Every audio format of the API is one (container, codec) pair of FFmpeg's, encoded by
:class:`AudioEncoder` as samples arrive, so a stream needs no second pass and a whole
reply is the same encoder fed once. Nothing here writes a header or a frame by hand.
"""

from __future__ import annotations

import base64
import io
from fractions import Fraction
from typing import Any, Literal, cast

import numpy as np

AudioFormat = Literal["wav", "flac", "mp3", "opus", "aac", "pcm"]

# format -> (FFmpeg muxer, FFmpeg encoder). ``pcm`` is raw 16-bit little-endian mono;
# ``opus`` is Ogg Opus (OpenAI's and vLLM-Omni's container); ``aac`` is ADTS (streamable).
_CODECS: dict[str, tuple[str, str]] = {
    "wav": ("wav", "pcm_s16le"),
    "flac": ("flac", "flac"),
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
    "pcm": ("s16le", "pcm_s16le"),
}

AUDIO_MEDIA_TYPES: dict[str, str] = {
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "pcm": "audio/pcm",
}

# FLAC's STREAMINFO header holds the total length, which a forward-only stream can only
# leave as "unknown"; libsndfile refuses such files, so FLAC is sent whole, never streamed.
STREAMABLE_AUDIO: frozenset[str] = frozenset({"wav", "mp3", "opus", "aac", "pcm"})

# Only for a reply that carries no audio at all (no chunk said the graph's rate): an empty file
# still needs a rate in its header. Audio outputs always carry their own ``sample_rate``.
EMPTY_AUDIO_SAMPLE_RATE = 24000


class _Sink:
    """A forward-only file for the muxer: what it writes is collected until taken."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class AudioEncoder:
    """One mono audio file in ``fmt``, encoded chunk by chunk.

    ``encode`` returns the bytes the muxer has written so far (possibly none: codecs buffer
    a frame or two), ``finish`` flushes the encoder and returns the rest. The concatenation
    of everything returned is one valid file. ``whole=True`` writes to a seekable buffer and
    returns everything from ``finish`` (headers then carry exact sizes).
    """

    def __init__(self, fmt: AudioFormat, sample_rate: int, *, whole: bool = False, rate: int | None = None):
        """``sample_rate``: the samples' rate; ``rate``: the file's, when it must be another (the Realtime API's
        PCM is 24 kHz whatever the model speaks at), else ``sample_rate`` or the codec's nearest above it."""
        import av

        muxer, codec_name = _CODECS[fmt]
        self._buffer: io.BytesIO | _Sink = io.BytesIO() if whole else _Sink()
        # bitexact: no encoder tags (a canonical 44-byte WAV header, as clients that skip it expect)
        self._container = av.open(self._buffer, "w", format=muxer, options={"fflags": "+bitexact"})
        codec = av.codec.Codec(codec_name, "w")
        # Codecs with a fixed set of rates (Opus: 8/12/16/24/48 kHz) get the input resampled
        # to the nearest one above; 24 kHz, the Qwen3-Omni rate, is native to every codec here.
        rates = sorted(codec.audio_rates or [])
        rate = rate or sample_rate
        rate = rate if not rates or rate in rates else next((r for r in rates if r > rate), rates[-1])
        # PyAV types add_stream by codec name as any kind of stream; an audio codec makes an audio stream.
        self._stream = cast("av.AudioStream", self._container.add_stream(codec_name, rate=rate, layout="mono"))
        offered = [f.name for f in codec.audio_formats or []]
        self._format = next(f for f in ("flt", "fltp", "s16", "s16p") if f in offered)
        self._stream.codec_context.format = self._format
        self._resampler = (
            av.AudioResampler(format=self._format, layout="mono", rate=rate) if rate != sample_rate else None
        )
        self.sample_rate = sample_rate
        self._samples = 0
        self._container.start_encoding()  # the header now: a reply without samples is still a valid file

    def encode(self, samples: np.ndarray) -> bytes:
        import av

        samples = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
        if samples.size:
            if self._resampler is not None:
                frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
            elif self._format.startswith("s16"):
                pcm = (samples * 32767.0).astype(np.int16)[None]
                frame = av.AudioFrame.from_ndarray(pcm, format=self._format, layout="mono")
            else:
                frame = av.AudioFrame.from_ndarray(samples[None], format=self._format, layout="mono")
            frame.sample_rate = self.sample_rate
            frame.pts = self._samples
            self._samples += samples.size
            for converted in self._resampler.resample(frame) if self._resampler else [frame]:
                self._mux(converted)
        return self._take()

    def finish(self) -> bytes:
        if self._resampler is not None:
            for converted in self._resampler.resample(None):
                self._mux(converted)
        self._mux(None)
        self._container.close()
        if isinstance(self._buffer, io.BytesIO):
            return self._buffer.getvalue()
        return self._take()

    def _mux(self, frame: Any) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def _take(self) -> bytes:
        return self._buffer.take() if isinstance(self._buffer, _Sink) else b""


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: AudioFormat) -> bytes:
    """Mono float samples in [-1, 1] -> one complete file (``pcm``: raw 16-bit little-endian)."""
    encoder = AudioEncoder(fmt, sample_rate, whole=True)
    encoder.encode(samples)
    return encoder.finish()


def encode_png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


# H.264 in MP4, 4:2:0, constant quality 18, x264's ultrafast preset, its threads as many as it likes:
# what vLLM-Omni's /v1/videos encodes with (``mux_av_video_audio_bytes``'s defaults and the options its
# ``serving_video.py`` passes), so the same frames make the same file on both servers (x264 is
# deterministic with threads too).
MP4_CODEC = "h264"
MP4_OPTIONS = {"crf": "18", "preset": "ultrafast", "threads": "0"}


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """uint8 frames [T, H, W, 3] (even H and W) -> one MP4 file (H.264, yuv420p)."""
    import av

    frames = np.asarray(frames, dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"expected uint8 frames [T, H, W, 3], got shape {frames.shape}")
    height, width = frames.shape[1:3]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        # PyAV types add_stream by codec name as any kind of stream; a video codec makes a video stream.
        stream = cast("av.VideoStream", container.add_stream(MP4_CODEC, rate=Fraction(fps).limit_denominator(10000)))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(MP4_OPTIONS)
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{b64(data)}"
