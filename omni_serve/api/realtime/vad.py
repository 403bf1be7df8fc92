"""Server VAD: Silero VAD (the ``silero-vad`` package, its model shipped in the wheel) over a session's audio.

Silero scores 16 kHz audio in 512-sample windows; the session's audio is 24 kHz pcm16, resampled by
FFmpeg (PyAV) as it arrives. :class:`SpeechDetector` reports the start and end of speech in
milliseconds of all audio the session has appended (OpenAI's ``audio_start_ms`` / ``audio_end_ms``
clock).

The work runs off the ingress's event loop, on :class:`VadWorkers`' threads (PyAV and torch release
the GIL while they compute): resampling and scoring cost ~10-25 ms of CPU per second of audio on one
core, measured, and one append may carry minutes of it. Each session detecting turns borrows its own
model (the model carries recurrent state) from the replica's pool: loading one costs ~70 ms of CPU,
so a session that ends gives it back for the next.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from omni_serve.api.realtime.events import PCM_RATE, TurnDetection

VAD_RATE = 16000
WINDOW = 512  # samples at 16 kHz: Silero's window (32 ms)
T = TypeVar("T")


@dataclass
class SpeechEdge:
    started: bool  # True: speech started; False: speech stopped
    at_ms: int  # on the session's audio clock


def load_model() -> Any:
    """A fresh Silero model (TorchScript, from the wheel): blocking, for a worker thread."""
    from silero_vad import load_silero_vad

    return load_silero_vad()


class SpeechDetector:
    """Speech edges in a stream of audio; ``feed`` runs on a worker thread, one call at a time."""

    def __init__(self, turn: TurnDetection, model: Any, clock_ms: float = 0.0):
        """``clock_ms``: the session's audio already appended (a detector made by ``session.update`` starts late)."""
        import av
        from silero_vad import VADIterator

        self.turn = turn
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=VAD_RATE)
        # speech_pad_ms=0: OpenAI's prefix padding is applied by the session to the committed audio,
        # and the end of speech is where speech ends (the silence duration is waited for, not added).
        # VADIterator resets the model's state: a borrowed model starts fresh.
        self._iterator: Any = VADIterator(
            model,
            threshold=turn.threshold,
            sampling_rate=VAD_RATE,
            min_silence_duration_ms=turn.silence_duration_ms,
            speech_pad_ms=0,
        )
        self._pending: np.ndarray = np.zeros(0, dtype=np.float32)
        self._fed = round(clock_ms * VAD_RATE / 1000)  # 16 kHz samples on the session's clock
        self._offset = self._fed  # where the iterator's own count starts (its last reset)
        self._in_pts = 0
        self.speaking = False

    def feed(self, pcm16: bytes) -> list[SpeechEdge]:
        """The speech edges in this piece of audio (pcm16 24 kHz mono), in order."""
        import av
        import torch

        samples = np.frombuffer(pcm16, dtype="<i2")[None]
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = PCM_RATE
        frame.pts = self._in_pts
        self._in_pts += samples.shape[1]
        parts = [self._pending] + [f.to_ndarray().reshape(-1) for f in self._resampler.resample(frame)]
        audio = np.concatenate(parts)
        edges: list[SpeechEdge] = []
        whole = len(audio) // WINDOW * WINDOW
        for start in range(0, whole, WINDOW):
            found = self._iterator(torch.from_numpy(audio[start : start + WINDOW].copy()))
            self._fed += WINDOW
            if found and "start" in found and not self.speaking:
                self.speaking = True
                edges.append(SpeechEdge(True, self._ms(found["start"])))
            elif found and "end" in found and self.speaking:
                self.speaking = False
                edges.append(SpeechEdge(False, self._ms(found["end"])))
        self._pending = audio[whole:]
        return edges

    def reset(self) -> None:
        """Forget speech in progress (the buffer was cleared or committed by the client)."""
        self._iterator.reset_states()
        self._offset = self._fed
        self.speaking = False

    def _ms(self, sample: int) -> int:
        return (self._offset + int(sample)) * 1000 // VAD_RATE


class VadWorkers:
    """One ingress replica's VAD threads and its idle Silero models.

    ``threads`` bounds the CPU the replica's sessions spend on VAD together; a session waits for its
    own work before it reads its next event, so one session holds at most one thread at a time and
    the others keep theirs. ``audio_s`` counts the audio the threads scored: work done, which tests
    bound (CPU time itself depends on the machine).
    """

    def __init__(self, threads: int, keep_models: int):
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="realtime-vad")
        self._idle: list[Any] = []
        self._keep = keep_models
        self.audio_s = 0.0

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._executor.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def borrow(self) -> Any:
        """A model for one session: an idle one, or a fresh one loaded on a worker thread."""
        return self._idle.pop() if self._idle else await self.run(load_model)

    def give_back(self, model: Any) -> None:
        if len(self._idle) < self._keep:
            self._idle.append(model)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
