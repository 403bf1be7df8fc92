"""What the video graphs' tests share: a job waited for through the official client, and an MP4 decoded by an
independent decoder (PyAV, FFmpeg's). Test code."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from tests.conftest import wait_until


def finished(client: Any, video_id: str, timeout_s: float = 300) -> Any:
    """The job once it completed or failed (``client``: an ``openai.OpenAI``)."""

    def done() -> Any:
        video = client.videos.retrieve(video_id)
        return video if video.status in ("completed", "failed") else None

    return wait_until(done, timeout_s, f"video {video_id} to finish", interval_s=0.3)


def decoded(mp4: bytes) -> tuple[np.ndarray, float]:
    """(frames [T, H, W, 3], frames per second) as PyAV (FFmpeg) reads the file."""
    import av

    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        return frames, float(stream.average_rate)
