"""Decoding audio replies with decoders independent of the encoder (FFmpeg through PyAV).

libsndfile (soundfile) reads WAV, FLAC, MP3 (mpg123) and Ogg Opus (libopus); FAAD2's ``faad``
decodes AAC and mutagen reads the ADTS headers (FAAD2 assumes implicit SBR for streams at
24 kHz or less and upsamples them 2x, so the stream's own rate comes from its header).
"""

from __future__ import annotations

import base64
import io
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from tests.vocoder import SAMPLES_PER_FRAME

CHAT_FORMATS = ["wav", "mp3", "flac", "opus", "aac", "pcm16"]
SPEECH_FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]
RAW = {"pcm", "pcm16"}


def decode(fmt: str, data: bytes, raw_rate: int) -> tuple[np.ndarray, int]:
    """(mono float samples, sample rate) of one file in ``fmt``; raw PCM is read at ``raw_rate``."""
    assert data, f"empty {fmt} data"
    if fmt in RAW:
        assert len(data) % 2 == 0
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0, raw_rate
    if fmt == "aac":
        return _decode_aac(data)
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    info = sf.info(io.BytesIO(data))
    assert info.format == {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "opus": "OGG"}[fmt], info
    assert samples.ndim == 1, "mono"
    return samples, rate


def _decode_aac(data: bytes) -> tuple[np.ndarray, int]:
    import mutagen.aac

    faad = shutil.which("faad")
    assert faad, "faad (FAAD2) is not installed: `make install-test` installs it (apt-get install faad)"
    with tempfile.TemporaryDirectory() as tmp:
        source, decoded = Path(tmp) / "in.aac", Path(tmp) / "out.wav"
        source.write_bytes(data)
        header = mutagen.aac.AAC(source).info
        assert header.channels == 1
        subprocess.run([faad, "-q", "-o", str(decoded), str(source)], check=True, capture_output=True)
        samples, faad_rate = sf.read(decoded, dtype="float32")
    if samples.ndim == 2:  # implicit-SBR/PS guess: FAAD2 renders mono as two equal channels
        np.testing.assert_array_equal(samples[:, 0], samples[:, 1])
        samples = samples[:, 0]
    factor = faad_rate // header.sample_rate
    assert faad_rate == factor * header.sample_rate and factor in (1, 2), (faad_rate, header.sample_rate)
    return samples[::factor], header.sample_rate


def spoken(text: str, rate: int = 24000) -> bytes:
    """``text`` spoken by Debian's espeak-ng (a real voice: a VAD hears speech), as pcm16 mono at ``rate``."""
    import av

    from tests import deps

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        deps.missing("espeak-ng", "make test installs it (.ci/install-debian-tools.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([espeak, "-w", str(path), text], check=True, capture_output=True)
        with av.open(str(path)) as container:
            resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
            frames = [out for frame in container.decode(audio=0) for out in resampler.resample(frame)]
            frames += resampler.resample(None)
    return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)


def whole_reply_audio(reply: dict[str, Any], rate: int = 24000) -> np.ndarray:
    """The WAV of a non-streamed chat reply asked with ``return_stage_metrics``, checked whole.

    Its length must be the talker's codec frames (the stage metrics' ``num_tokens_out``) less the
    vocoder's lag, so a chunk lost on the way fails it. A random-weight talker may sample codec EOS at
    its first step (measured: 1 reply in 366 on the tiny graph's talker sampling): zero frames are an
    empty WAV, whole, if the talker finished with ``stop``.
    """
    choice = reply["choices"][0]
    samples, got_rate = sf.read(io.BytesIO(base64.b64decode(choice["message"]["audio"]["data"])), dtype="float32")
    assert got_rate == rate and samples.ndim == 1 and choice["finish_reason"] in ("stop", "length"), choice
    (talker,) = [m for m in reply["metrics"]["stage_metrics"].values() if m["stage_name"] == "talker"]
    frames = talker["num_tokens_out"]
    if frames == 0:
        assert samples.size == 0 and talker["finish_reason"] == "stop", (samples.size, talker)
    else:
        lag = frames * SAMPLES_PER_FRAME - samples.size  # what the vocoder holds back: under one frame
        assert 0 < lag < SAMPLES_PER_FRAME, f"{samples.size} samples for {frames} codec frames"
    return samples


def speech_frames(data: bytes, fmt: str, rate: int, samples_per_frame: int) -> np.ndarray:
    """A TTS reply decoded: whole codec frames (``samples_per_frame`` samples each) of finite, non-silent audio
    at ``rate``."""
    decoded, got_rate = decode(fmt, data, rate)
    assert got_rate == rate and decoded.ndim == 1
    frames, rest = divmod(decoded.size, samples_per_frame)
    assert rest == 0 and frames >= 1, f"{decoded.size} samples are not whole frames"
    assert np.isfinite(decoded).all() and np.abs(decoded).max() > 1e-3, "silent audio"
    return decoded
