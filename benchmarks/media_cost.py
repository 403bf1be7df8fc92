"""What one media item costs where: the ingress's checks against the entry stage's decoding and processor.

    python benchmarks/media_cost.py [--repeat 10]

For each item (a 1280x720 JPEG, 10 s of WAV at 16 kHz, 10 s of stereo MP3 at 44.1 kHz, a 10 s
640x360 H.264 video at 25 fps with an AAC track), in this process, on one thread, median of
``--repeat`` runs:

- ingress: what the ingress does per part: strict base64 decoding of the data URL and the
  magic-byte sniff (``omni_serve.media.inputs.data_url_bytes`` + ``check_format``);
- decode: what the entry stage does before its model: ``omni_serve.media.inputs.decode`` (Pillow /
  FFmpeg through PyAV, resampling to 16 kHz mono, video frames sampled at 2 fps, the track too);
- processor: the tiny checkpoint's ``Qwen3OmniMoeProcessor`` (Whisper features, Qwen2-VL image and
  video processors) on the decoded item, with the tiny graphs' pixel budget (64x64 px), and with a
  budget that keeps the item's own resolution (the work a real model's processor does on it).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omni_serve.checkpoints.tiny_omni import ensure_tiny_omni
from omni_serve.media import inputs as media_input
from omni_serve.models.chat_template import template_messages
from omni_serve.models.processor_media import processor_media
from omni_serve.types import ChatMessage, MediaPart, TextPart

TINY_SIZE = {"shortest_edge": 64, "longest_edge": 4096}  # the tiny graphs' mm_processor_kwargs
FULL_SIZE = {"shortest_edge": 64, "longest_edge": 1 << 24}  # nothing is scaled down


def _sweep(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t * (1 + t / seconds))).astype(np.float32)


def _picture(width: int, height: int, seed: int = 0) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(seed).integers(0, 24, (height, width, 3))
    return (np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], -1) + noise).clip(0, 255).astype(np.uint8)


def jpeg(width: int = 1280, height: int = 720) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(_picture(width, height)).save(out, format="JPEG", quality=85)
    return out.getvalue()


def wav(seconds: float = 10.0) -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, _sweep(seconds, 16000), 16000, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _encode(fmt: str, video: tuple[str, int, int, int] | None, audio: tuple[str, int, int], seconds: float) -> bytes:
    """A container of ``seconds``: optional video (codec, fps, width, height) and audio (codec, rate, channels)."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        codec, rate, channels = audio  # every stream is added before the first packet is written
        layout = "stereo" if channels == 2 else "mono"
        track = container.add_stream(codec, rate=rate, layout=layout)
        if video is not None:
            codec, fps, width, height = video
            stream = container.add_stream(codec, rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            picture = _picture(width, height)
            for i in range(int(seconds * fps)):
                frame = av.VideoFrame.from_ndarray(np.roll(picture, 8 * i, axis=1), format="rgb24")
                frame.pts = i
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
        frame = av.AudioFrame.from_ndarray(np.tile(_sweep(seconds, rate), (channels, 1)), format="fltp", layout=layout)
        frame.sample_rate, frame.pts = rate, 0
        container.mux([*track.encode(frame), *track.encode(None)])
    return out.getvalue()


def items() -> dict[str, tuple[str, str, bytes]]:
    """name -> (kind, media type, bytes)."""
    return {
        "image: JPEG 1280x720": ("image", "image/jpeg", jpeg()),
        "audio: WAV 10 s 16 kHz mono": ("audio", "audio/wav", wav()),
        "audio: MP3 10 s 44.1 kHz stereo": ("audio", "audio/mpeg", _encode("mp3", None, ("libmp3lame", 44100, 2), 10)),
        "video: MP4 10 s 640x360 25 fps H.264 + AAC": (
            "video",
            "video/mp4",
            _encode("mp4", ("libx264", 25, 640, 360), ("aac", 44100, 2), 10),
        ),
    }


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up (imports, codec init)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoProcessor, AutoTokenizer

    path = str(ensure_tiny_omni())
    processor, tokenizer = AutoProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    config = media_input.MediaInputConfig()
    rows = []
    for name, (kind, media_type, data) in items().items():
        url = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
        video_track = kind == "video"

        def ingress(url: str = url, kind: str = kind) -> None:
            media_input.check_format(media_input.data_url_bytes(url, "p", config.max_bytes), kind, "p")

        def decode(data: bytes = data, kind: str = kind, with_track: bool = video_track) -> Any:
            return media_input.decode(kind, data, "p", config, 16000, audio_in_video=with_track)

        decoded = decode()
        message = ChatMessage(role="user", content=[TextPart(text="What is this?"), MediaPart(type=kind, param="p")])
        text = tokenizer.apply_chat_template(template_messages([message]), add_generation_prompt=True, tokenize=False)

        def process(size: dict[str, int], decoded: Any = decoded, text: str = text) -> int:
            inputs = processor(text=text, return_tensors="pt", size=size, **processor_media([decoded]))
            return int(inputs["input_ids"].shape[1])

        rows.append(
            {
                "item": name,
                "bytes": len(data),
                "ingress_ms": median_ms(ingress, args.repeat),
                "decode_ms": median_ms(decode, args.repeat),
                "processor_tiny_ms": median_ms(lambda: process(TINY_SIZE), args.repeat),
                # audio features do not depend on a pixel budget
                "processor_full_ms": median_ms(lambda: process(FULL_SIZE), args.repeat) if kind != "audio" else None,
            }
        )
    print(
        "| item | bytes | ingress: base64 + sniff (ms) | entry stage: decode (ms) | processor, tiny budget (ms) "
        "| processor, native resolution (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        full = "–" if r["processor_full_ms"] is None else f"{r['processor_full_ms']:.1f}"
        print(
            f"| {r['item']} | {r['bytes']:,} | {r['ingress_ms']:.2f} | {r['decode_ms']:.1f} | "
            f"{r['processor_tiny_ms']:.1f} | {full} |"
        )
    load = os.getloadavg()
    print(f"\n{os.cpu_count()} CPUs, one thread; load average at the end: {' / '.join(f'{x:.2f}' for x in load)}")


if __name__ == "__main__":
    main()
