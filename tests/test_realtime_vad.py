"""The server VAD (Silero through :class:`SpeechDetector`) on real speech, in process: no Ray."""

from __future__ import annotations

from omni_serve.api.realtime.events import TurnDetection
from omni_serve.api.realtime.vad import SpeechDetector, load_model
from tests.audio import spoken

RATE = 24000


def test_speech_edges_are_on_the_sessions_clock() -> None:
    """A detector made mid-session (``session.update``) reports times on the session's clock, not its own."""
    speech = spoken("Hello, how are you today?")
    lead_ms, clock_ms = 600, 5000.0
    audio = bytes(RATE * 2 * lead_ms // 1000) + speech + bytes(RATE * 2)
    detector = SpeechDetector(TurnDetection(silence_duration_ms=400), load_model(), clock_ms=clock_ms)
    edges = [e for i in range(0, len(audio), 4800) for e in detector.feed(audio[i : i + 4800])]
    assert [e.started for e in edges] == [True, False], edges
    speech_ms = len(speech) * 1000 // (RATE * 2)
    assert clock_ms + lead_ms - 50 <= edges[0].at_ms <= clock_ms + lead_ms + 300, edges
    assert edges[0].at_ms < edges[1].at_ms <= clock_ms + lead_ms + speech_ms + 100, edges


def test_silence_is_not_speech() -> None:
    detector = SpeechDetector(TurnDetection(), load_model())
    assert detector.feed(bytes(RATE * 2 * 3)) == [] and not detector.speaking
