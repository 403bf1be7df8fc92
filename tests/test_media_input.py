"""Media bytes in process: sniffing, data URLs, and decoding under the limits, checked against
independent decoders (soundfile for audio, Pillow's own reader for images)."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import soundfile as sf
from PIL import Image as PILImage

from omni_serve.media import inputs as mi
from omni_serve.media.policy import MediaPolicy
from omni_serve.types import MediaPart
from tests import media
from tests.media import flac, mp4, png, png_bomb, tone, wav, wav_claiming

P = "messages.0.content.1"
CONFIG = mi.MediaInputConfig(
    max_bytes=1 << 20,
    max_image_pixels=128 * 128,
    max_audio_seconds=5,
    max_video_seconds=5,
    max_video_frames=6,
    video_fps=2.0,
)


def refused(call, status: int = 400) -> str:
    return media.refused(call, P, status)


def test_sniffing_by_magic_bytes() -> None:
    assert mi.sniff(png()) == "png" and mi.sniff(wav()) == "wav" and mi.sniff(mp4()) == "mp4"
    assert mi.sniff(flac(tone(0.1))) == "flac"
    buffer = io.BytesIO()
    PILImage.new("RGB", (4, 4)).save(buffer, format="JPEG")
    assert mi.sniff(buffer.getvalue()) == "jpeg"
    assert mi.sniff(b"#EXTM3U\n#EXTINF:1,\nhttp://127.0.0.1/secret.ts\n") is None  # an HLS playlist is no media
    assert mi.sniff(b"<html>") is None and mi.sniff(b"") is None


def test_format_must_fit_the_part() -> None:
    assert mi.check_format(png(), "image", P) == "png"
    assert "found wav data" in refused(lambda: mi.check_format(wav(), "image", P))
    assert "found no known format" in refused(lambda: mi.check_format(b"GIF8 not quite", "image", P))
    assert "empty" in refused(lambda: mi.check_format(b"", "audio", P))
    assert "format is 'mp3' but the data is wav" in refused(lambda: mi.check_format(wav(), "audio", P, "mp3"))
    assert mi.check_format(mp4(), "audio", P) == "mp4"  # an mp4 may carry an audio part
    assert "found png data" in refused(lambda: mi.check_format(png(), "video", P))


def test_data_urls_and_base64() -> None:
    body = png()
    encoded = base64.b64encode(body).decode()
    assert mi.data_url_bytes(f"data:image/png;base64,{encoded}", P, 1 << 20) == body
    assert mi.data_url_bytes(f"data:audio/wav;base64,{encoded}", P, 1 << 20) == body  # declared type not trusted
    assert "invalid base64" in refused(lambda: mi.data_url_bytes("data:image/png;base64,@@@@", P, 1 << 20))
    assert "invalid base64" in refused(lambda: mi.data_url_bytes(f"data:image/png;base64,{encoded[:-3]}", P, 1 << 20))
    assert "base64-encoded" in refused(lambda: mi.data_url_bytes("data:image/png,rawbytes", P, 1 << 20))
    assert "malformed" in refused(lambda: mi.data_url_bytes("data:image/png;base64", P, 1 << 20))
    # Over the cap: refused from the encoded length, before decoding a byte.
    assert "over the limit" in refused(lambda: mi.base64_bytes("A" * 4000, P, 1000), 413)
    assert "over the limit" in refused(lambda: mi.base64_bytes(base64.b64encode(b"x" * 1001).decode(), P, 1000), 413)


def test_images_decode_to_the_pixels_pillow_reads() -> None:
    body = png(40, 24)
    decoded = mi.decode("image", body, P, CONFIG, 16000)
    expected = np.asarray(PILImage.open(io.BytesIO(body)).convert("RGB"))
    np.testing.assert_array_equal(decoded.pixels, expected)
    assert decoded.pixels.flags.writeable


def test_decompression_bombs_are_refused_from_the_header() -> None:
    assert "over the pixel limit" in refused(lambda: mi.decode("image", png_bomb(), P, CONFIG, 16000))  # Pillow's
    assert "1000x1000 pixels is over the limit" in refused(
        lambda: mi.decode("image", png_bomb(1000, 1000), P, CONFIG, 16000)
    )
    big = png(200, 100)  # a real image over this config's 128x128 pixels
    assert "200x100 pixels" in refused(lambda: mi.decode("image", big, P, CONFIG, 16000))
    truncated = png(64, 64)[:200]
    assert "not a valid png image" in refused(lambda: mi.decode("image", truncated, P, CONFIG, 16000))


def test_audio_is_resampled_to_the_model_rate_in_mono() -> None:
    decoded = mi.decode("audio", wav(1.0, rate=16000), P, CONFIG, 16000)
    expected, rate = sf.read(io.BytesIO(wav(1.0, rate=16000)), dtype="float32")
    assert rate == 16000
    np.testing.assert_array_equal(decoded.samples, expected)  # no resampling: the same samples
    stereo = np.stack([tone(1.0, 44100), tone(1.0, 44100, hz=220.0)], axis=1)
    buffer = io.BytesIO()
    sf.write(buffer, stereo, 44100, format="WAV")
    resampled = mi.decode("audio", buffer.getvalue(), P, CONFIG, 16000).samples
    assert resampled.dtype == np.float32 and resampled.ndim == 1 and abs(resampled.size - 16000) <= 64


def test_audio_length_is_capped_from_header_and_while_decoding() -> None:
    assert "6.0 s is longer than the limit of 5 s" in refused(lambda: mi.decode("audio", wav(6.0), P, CONFIG, 16000))
    # A header claiming an hour is not believed: only the samples that are there are decoded.
    assert mi.decode("audio", wav_claiming(3600), P, CONFIG, 16000).samples.size == 1600  # its 0.1 s
    # 10 s of silence is a few hundred bytes of FLAC: caught while decoding, whatever the header says.
    silent = flac(np.zeros(160_000, np.float32))
    assert len(silent) < 8000
    assert "longer than the limit of 5 s" in refused(lambda: mi.decode("audio", silent, P, CONFIG, 16000))
    assert "not a valid mp3 file" in refused(lambda: mi.decode("audio", b"ID3" + b"\0" * 64, P, CONFIG, 16000))


def test_video_frames_sampled_at_the_configured_rate_with_its_audio_track() -> None:
    body = mp4(seconds=2.0, fps=4)  # 8 frames at 4 fps: sampled at 2 fps -> 4 frames
    video = mi.decode("video", body, P, CONFIG, 16000, audio_in_video=True)
    assert video.frames.shape == (4, 32, 48, 3) and video.fps == 2.0
    assert video.audio is not None and abs(video.audio.size - 32000) < 2048  # AAC adds its priming samples
    assert mi.decode("video", body, P, CONFIG, 16000).audio is None  # the track only when it is input


def test_video_limits() -> None:
    assert "more than 6 frames" in refused(lambda: mi.decode("video", mp4(seconds=4.0, fps=2), P, CONFIG, 16000))
    small = CONFIG.model_copy(update={"max_image_pixels": 32 * 32})
    assert "48x32 pixels" in refused(lambda: mi.decode("video", mp4(), P, small, 16000))
    short = CONFIG.model_copy(update={"max_video_seconds": 1.0})
    assert "longer than the limit" in refused(lambda: mi.decode("video", mp4(seconds=2.0), P, short, 16000))
    mute = mp4(audio=False)
    assert "no audio track" in refused(lambda: mi.decode("video", mute, P, CONFIG, 16000, audio_in_video=True))
    assert "not a valid mp4 file" in refused(lambda: mi.decode("video", mp4()[:100], P, CONFIG, 16000))


def test_load_media_reads_references_and_urls_concurrently(tmp_path) -> None:
    (tmp_path / "cat.png").write_bytes(png(16, 16))
    policy = MediaPolicy(allowed_local_dir=str(tmp_path))
    parts = [
        MediaPart(type="audio", param="messages.0.content.0", data=wav(0.5)),
        MediaPart(type="image", param="messages.0.content.1", url=f"file://{tmp_path}/cat.png"),
    ]
    audio, image = asyncio.run(mi.load_media(parts, policy, CONFIG, 16000))
    assert isinstance(audio, mi.Audio) and audio.samples.size == 8000
    assert isinstance(image, mi.Image) and image.pixels.shape == (16, 16, 3)
