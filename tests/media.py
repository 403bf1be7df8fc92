"""Test media: real PNG / WAV / MP4 bytes made with Pillow, soundfile and PyAV, hostile ones built by
hand, and a local HTTP media server (127.0.0.1 only) that records every request it receives."""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omni_serve.exceptions import InvalidStageInput

# --- valid media -------------------------------------------------------------------------------


def refused(call: Callable[[], object], param: str, status: int = 400) -> str:
    """The message of the InvalidStageInput ``call`` raises, checked to name ``param`` (first) with ``status``."""
    with pytest.raises(InvalidStageInput) as info:
        call()
    assert info.value.param == param and str(info.value).startswith(f"{param}: ") and info.value.status == status
    return str(info.value)


def png(width: int = 40, height: int = 24, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def tone(seconds: float, rate: int = 16000, hz: float = 440.0, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    noise = 0.05 * np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * hz * t) + noise).astype(np.float32)


def wav(seconds: float = 1.0, rate: int = 16000, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, tone(seconds, rate, seed=seed), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def described(*media: dict) -> list[dict]:
    """A chat message's content: the media parts, then a text part asking about them."""
    return [*media, {"type": "text", "text": "Describe it."}]


def image_part() -> dict:
    """A 64x64 PNG as an ``image_url`` content part (a data URL)."""
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()},
    }


def audio_part() -> dict:
    """A 1 s 16 kHz WAV tone as an ``input_audio`` content part."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(1.0)).decode(), "format": "wav"}}


def flac(samples: np.ndarray, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format="FLAC")
    return buffer.getvalue()


def mp4(seconds: float = 2.0, fps: int = 2, width: int = 48, height: int = 32, audio: bool = True) -> bytes:
    """An MPEG-4 video (moving colour bars) at ``fps``, with a 16 kHz AAC tone as its audio track."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        track = container.add_stream("aac", rate=16000, layout="mono") if audio else None
        frames = int(seconds * fps)
        for i in range(frames):
            pixels = np.zeros((height, width, 3), np.uint8)
            pixels[:, :, 0] = 255 * i // max(frames - 1, 1)
            pixels[height // 4 : height // 2, width // 4 : width // 2, 1] = 200
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = i
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        if track is not None:
            samples = av.AudioFrame.from_ndarray(tone(seconds, hz=330.0)[None], format="flt", layout="mono")
            samples.sample_rate, samples.pts = 16000, 0
            for packet in [*track.encode(samples), *track.encode(None)]:
                container.mux(packet)
    return buffer.getvalue()


# --- hostile media -----------------------------------------------------------------------------


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (30 GB as RGB) in a few dozen bytes."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + (_png_chunk(b"IEND", b""))
    )


def wav_claiming(seconds: float, rate: int = 16000) -> bytes:
    """A WAV header claiming ``seconds`` of 16-bit mono audio, followed by a tenth of a second of it."""
    data_bytes = int(seconds * rate) * 2
    header = b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
    return header + b"data" + struct.pack("<I", data_bytes) + b"\0" * (rate // 5)


# --- a local HTTP media server -----------------------------------------------------------------


@dataclass
class Route:
    body: bytes = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    drip_s: float = 0.0  # pause before each byte of the body
    stall_s: float = 0.0  # pause before answering at all


class MediaServer:
    """Serves fixed routes on 127.0.0.1:``port``; ``requests`` lists every path asked for, in order."""

    def __init__(self, port: int):
        self.port = port
        self.routes: dict[str, Route] = {}
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                server.requests.append(self.path)
                route = server.routes.get(self.path, Route(b"not found", 404))
                if route.stall_s:
                    time.sleep(route.stall_s)
                self.send_response(route.status)
                headers = {"Content-Length": str(len(route.body)), **route.headers}
                for key, value in headers.items():
                    if value:
                        self.send_header(key, value)
                self.end_headers()
                try:
                    if route.drip_s:
                        for i in range(len(route.body)):
                            self.wfile.write(route.body[i : i + 1])
                            self.wfile.flush()
                            time.sleep(route.drip_s)
                    else:
                        self.wfile.write(route.body)
                except (BrokenPipeError, ConnectionResetError):  # the fetcher gave up: as it should
                    pass

            def log_message(self, *args: object) -> None:  # the access log is ``requests``
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def route(self, path: str, body: bytes = b"", **kwargs: object) -> str:
        self.routes[path] = Route(body, **kwargs)  # type: ignore[arg-type]
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> MediaServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
