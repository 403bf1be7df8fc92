"""The keyword arguments a Hugging Face multimodal processor takes for a prompt's decoded media."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_serve.media.inputs import Audio, Decoded, Image, Video


def processor_media(media: Sequence[Decoded]) -> dict[str, Any]:
    """``Qwen3OmniMoeProcessor`` keyword arguments for decoded media in prompt order.

    Audio is listed where the prompt consumes it: audio parts, and a video's own track where the
    video is when it is input too (``use_audio_in_video``); all videos were sampled at one fps.
    """
    audio = [
        m.samples if isinstance(m, Audio) else m.audio
        for m in media
        if isinstance(m, Audio) or (isinstance(m, Video) and m.audio is not None)
    ]
    videos = [m for m in media if isinstance(m, Video)]
    kwargs: dict[str, Any] = {
        "images": [m.pixels for m in media if isinstance(m, Image)] or None,
        "videos": [v.frames for v in videos] or None,
        "audio": audio or None,
    }
    if videos:
        kwargs.update(fps=videos[0].fps, use_audio_in_video=any(v.audio is not None for v in videos))
    return kwargs
