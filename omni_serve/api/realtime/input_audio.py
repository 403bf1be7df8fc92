"""A session's input audio buffer, and the turns the server VAD finds in it.

Appended audio is bounded three ways: the buffer holds at most ``max_buffered_audio_s`` (with server
VAD, silence outside a turn is not kept), a session appends at most ``audio_realtime_factor``
seconds of audio per second of wall time (bursts of ``audio_burst_s``: the VAD's CPU is per audio
second), and the session's bytes (checked by the session). The VAD runs on the replica's
:class:`~omni_serve.api.realtime.vad.VadWorkers` threads, never on the event loop; the session waits
for it before reading its next event, so the edges come in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from omni_serve.api.openai.errors import APIError
from omni_serve.api.realtime.budget import TokenBucket
from omni_serve.api.realtime.conversation import new_id
from omni_serve.api.realtime.events import PCM_RATE, TurnDetection
from omni_serve.api.realtime.vad import SpeechDetector, SpeechEdge, VadWorkers
from omni_serve.graph.config import RealtimeConfig

BYTES_PER_MS = PCM_RATE * 2 // 1000


class InputAudio:
    def __init__(self, limits: RealtimeConfig, workers: VadWorkers, turn: TurnDetection | None):
        self.limits = limits
        self.workers = workers
        self.turn = turn  # None: manual turns (no VAD)
        self.buffer = bytearray()  # uncommitted input audio, pcm16 24 kHz
        self.appended_ms = 0.0  # all audio appended in the session (the VAD's clock)
        self.speech_item: str | None = None  # the user item the speech in progress will become
        self.speech_start_ms = 0
        self._budget = TokenBucket(limits.audio_realtime_factor, limits.audio_burst_s)
        self._model: Any = None  # borrowed from the workers' pool on the first audio the VAD hears
        self._detector: SpeechDetector | None = None
        self._job: concurrent.futures.Future[list[SpeechEdge]] | None = None

    def set_turn(self, turn: TurnDetection | None) -> None:
        """New turn detection settings (``session.update``): a new detector from the next append on."""
        self.turn = turn
        self._detector = None
        self.speech_item = None

    async def append(self, pcm: bytes) -> list[SpeechEdge]:
        """Buffer ``pcm``; with server VAD, the speech edges it holds, in order."""
        limit = self.limits.max_buffered_audio_s
        seconds = len(pcm) / (BYTES_PER_MS * 1000)
        if len(self.buffer) / (BYTES_PER_MS * 1000) + seconds > limit:
            raise APIError(
                400,
                f"audio: the input audio buffer would hold more than {limit:g} s (realtime.max_buffered_audio_s); "
                "commit or clear it",
                type="invalid_request_error",
                param="audio",
                code="input_audio_buffer_full",
            )
        if not self._budget.take(seconds):
            rate, burst = self.limits.audio_realtime_factor, self.limits.audio_burst_s
            raise APIError(
                429,
                f"audio: {seconds:.1f} s of audio is more than this session may append now: {rate:g} s of audio "
                f"per second (realtime.audio_realtime_factor), bursts of {burst:g} s (realtime.audio_burst_s); "
                "this append was dropped",
                type="rate_limit_error",
                param="audio",
                code="audio_rate_exceeded",
            )
        self.buffer += pcm
        clock_ms = self.appended_ms
        self.appended_ms += len(pcm) / BYTES_PER_MS
        if self.turn is None:
            return []
        if self._model is None:
            self._model = await self.workers.borrow()
        if self._detector is None:
            self._detector = SpeechDetector(self.turn, self._model, clock_ms)
        self._job = self.workers.submit(self._detector.feed, pcm)
        edges = await asyncio.wrap_future(self._job)
        self.workers.audio_s += seconds
        return edges

    def trim(self) -> None:
        """After an append's edges: keep only what a turn starting now would include (its prefix padding)."""
        if self.turn is not None and not (self._detector is not None and self._detector.speaking):
            keep = self.turn.prefix_padding_ms * BYTES_PER_MS
            del self.buffer[: max(0, len(self.buffer) - keep)]

    def _start_ms(self) -> float:
        """Where the buffer starts on the session's audio clock."""
        return self.appended_ms - len(self.buffer) / BYTES_PER_MS

    def speech_started(self, at_ms: int) -> dict[str, Any]:
        """The VAD heard speech start: the fields of ``input_audio_buffer.speech_started``."""
        assert self.turn is not None
        self.speech_start_ms = max(int(self._start_ms()), at_ms - self.turn.prefix_padding_ms)
        self.speech_item = new_id("item")
        return {"audio_start_ms": self.speech_start_ms, "item_id": self.speech_item}

    def speech_stopped(self, at_ms: int) -> tuple[str, bytes]:
        """The VAD heard speech stop: the turn's item id and its audio (prefix padding included), taken out."""
        item_id = self.speech_item or new_id("item")
        start = max(0, round((self.speech_start_ms - self._start_ms()) * BYTES_PER_MS) // 2 * 2)
        end = max(start, round((at_ms - self._start_ms()) * BYTES_PER_MS) // 2 * 2)
        speech = bytes(self.buffer[start:end])
        del self.buffer[:end]
        self.speech_item = None
        return item_id, speech

    def take(self) -> bytes:
        """The whole buffer, for a manual commit; the buffer is then empty."""
        audio = bytes(self.buffer)
        self.clear()
        return audio

    def clear(self) -> None:
        self.buffer.clear()
        self.speech_item = None
        if self._detector is not None:
            self._detector.reset()

    def close(self) -> None:
        """The session ended: its model goes back to the pool once no VAD work of it runs any more."""
        model, job, self._model, self._detector = self._model, self._job, None, None
        if model is None:
            return
        if job is None or job.done() or job.cancel():
            self.workers.give_back(model)
        else:  # still scoring on a worker thread (the session was cancelled while it waited)
            loop = asyncio.get_running_loop()
            job.add_done_callback(lambda _: loop.call_soon_threadsafe(self.workers.give_back, model))
