"""Server VAD: Silero VAD (the ``silero-vad`` package, its model shipped in the wheel) over a session's audio.

Silero scores 16 kHz audio in 512-sample windows; the session's audio is 24 kHz pcm16, resampled by
FFmpeg (PyAV) as it arrives. :class:`SpeechDetector` reports the start and end of speech in
milliseconds of all audio the session has appended (OpenAI's ``audio_start_ms`` / ``audio_end_ms``
clock). The model is small (~2 MB, ~0.1 ms per window on one core) and runs in the ingress's event
loop; each session has its own model instance because the model carries recurrent state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_serve.api.realtime.events import PCM_RATE, TurnDetection

VAD_RATE = 16000
WINDOW = 512  # samples at 16 kHz: Silero's window (32 ms)


@dataclass
class SpeechEdge:
    started: bool  # True: speech started; False: speech stopped
    at_ms: int  # on the session's audio clock


class SpeechDetector:
    def __init__(self, turn: TurnDetection, clock_ms: float = 0.0):
        """``clock_ms``: the session's audio already appended (a detector made by ``session.update`` starts late)."""
        import av
        from silero_vad import VADIterator, load_silero_vad

        self.turn = turn
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=VAD_RATE)
        # speech_pad_ms=0: OpenAI's prefix padding is applied by the session to the committed audio,
        # and the end of speech is where speech ends (the silence duration is waited for, not added).
        self._iterator: Any = VADIterator(
            load_silero_vad(),
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
            import torch

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
