"""Codec frames as self-contained chunks, and a chunk's decode trimmed of its left context.

A talker's codec frames reach code2wav in chunks (:class:`CodecChunker`); each carries up to a left
context of frames before it, so any code2wav replica decodes any chunk without state, and the samples
that context yields again are cut from its decode (:func:`trim_left_context`, which every codec-to-waveform
stage uses, vLLM-Omni's included).

``qwen3_omni.codec_chunk`` payloads: ``codes`` int64 [groups, left_context + frames]; meta
``left_context``, ``index``, ``start_frame``, ``num_frames``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_serve.payload import HandoffPayload

CODEC_CHUNK = "qwen3_omni.codec_chunk"  # the kind's name, from the first family that used it
# A decoder's output rate where its output does not say (vLLM-Omni's outputs carry "sr"): 24 kHz,
# Qwen3-Omni's code2wav's.
DEFAULT_SAMPLE_RATE = 24000


class CodecChunker:
    """Cuts a growing stream of codec frames into self-contained chunks.

    Chunk 0 has ``first_chunk_frames`` frames, later ones ``chunk_frames``; each carries up
    to ``left_context_frames`` frames before it. ``push`` returns the chunks completed so
    far, ``flush`` the remainder. No I/O; the talker engine feeds it frame by frame.
    """

    def __init__(self, first_chunk_frames: int, chunk_frames: int, left_context_frames: int):
        if first_chunk_frames < 1 or chunk_frames < 1 or left_context_frames < 0:
            raise ValueError("chunk sizes must be >= 1 and the left context >= 0")
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.left_context_frames = left_context_frames
        self._frames: list[np.ndarray] = []  # each [groups]
        self._start = 0  # first frame not yet in a chunk
        self._index = 0

    @property
    def num_frames(self) -> int:
        return len(self._frames)

    def _next_size(self) -> int:
        return self.first_chunk_frames if self._index == 0 else self.chunk_frames

    def _cut(self, end: int) -> HandoffPayload:
        ctx = min(self.left_context_frames, self._start)
        codes = np.stack(self._frames[self._start - ctx : end], axis=1).astype(np.int64)  # [groups, ctx + n]
        payload = HandoffPayload(
            kind=CODEC_CHUNK,
            tensors={"codes": codes},
            meta={
                "left_context": ctx,
                "index": self._index,
                "start_frame": self._start,
                "num_frames": end - self._start,
            },
        )
        self._start = end
        self._index += 1
        return payload

    def push(self, frames: np.ndarray) -> list[HandoffPayload]:
        """Add frames ([groups] or [groups, n]); return the chunks that became complete."""
        frames = np.asarray(frames)
        self._frames.extend(frames.T if frames.ndim == 2 else [frames])
        out = []
        while len(self._frames) - self._start >= self._next_size():
            out.append(self._cut(self._start + self._next_size()))
        return out

    def flush(self) -> list[HandoffPayload]:
        """The last, possibly short, chunk (nothing if every frame is already in a chunk)."""
        return [self._cut(len(self._frames))] if len(self._frames) > self._start else []


def chunk_codec_codes(
    codes: np.ndarray, first_chunk_frames: int = 25, chunk_frames: int = 25, left_context_frames: int = 25
) -> list[HandoffPayload]:
    """All chunks of ``codes`` [groups, frames] at once (what the streaming chunker yields in total)."""
    chunker = CodecChunker(first_chunk_frames, chunk_frames, left_context_frames)
    return chunker.push(np.asarray(codes)) + chunker.flush()


def trim_left_context(wav: Any, num_frames: int, left_context: int, samples_per_frame: int) -> Any:
    """The samples of a decode of ``num_frames`` codec frames that belong after its left context.

    A decode yields ``num_frames * samples_per_frame - lag`` samples (the transposed convolutions
    hold back ``lag``); the first ``left_context`` frames' samples minus that lag were already
    emitted by the previous chunk (see :func:`decode_codec_chunk`). Works on any 1-D sequence.
    """
    if left_context <= 0:
        return wav
    lag = num_frames * samples_per_frame - len(wav)
    return wav[max(left_context * samples_per_frame - lag, 0) :]
