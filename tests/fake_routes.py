"""The shipped graphs, a fake TTS graph and its fake stages: routes tested without Ray."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from omni_serve.graph.transport import StageTransport
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, StageOutput, StageRequest, Usage

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"


CHAT, SPEECH, VOICES = "/v1/chat/completions", "/v1/audio/speech", "/v1/audio/voices"


REALTIME, TRANSCRIPTIONS, IMAGES = "/v1/realtime", "/v1/audio/transcriptions", "/v1/images/generations"


EDITS, VIDEOS = "/v1/images/edits", "/v1/videos"


# A TTS pipeline's graph (vLLM-Omni's qwen3_tts: a talker that takes the text to speak, then its codec
# decoder), as the generator writes it; graph validation reads no declaration, so no vLLM-Omni here.
TTS_GRAPH = {
    "served_model_name": "tiny-tts",
    "stage_timeout_s": 30,
    "stages": [
        {
            "name": "qwen3_tts",
            "engine": "vllm_omni",
            "engine_args": {"model": "tiny", "pipeline": "qwen3_tts", "stage_id": 0, "entry": "speech"},
        },
        {
            "name": "code2wav",
            "engine": "vllm_omni",
            "inputs": ["qwen3_tts"],
            "engine_args": {"model": "tiny", "pipeline": "qwen3_tts", "stage_id": 1},
            "final_output": "audio",
        },
    ],
}


class FakeTTS(StageTransport):
    """The TTS graph's two stages: the talker speaks ``reply`` (the text to speak) in ``voice`` as two codec
    chunks; the decoder turns each chunk into audio samples."""

    def __init__(self) -> None:
        self.calls: list[StageRequest] = []

    async def voices(self, stage: str) -> list[str]:
        return ["vivian", "ryan"] if stage == "qwen3_tts" else []

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncIterator[StageOutput]:
        self.calls.append(request)
        if stage == "qwen3_tts":
            assert request.text_to_speak is not None and request.voice == "ryan"
            for i, word in enumerate(request.text_to_speak.split()):
                payload = HandoffPayload("fake.codec", {"codes": np.full(4, len(word), np.int64)})
                last = i == len(request.text_to_speak.split()) - 1
                yield StageOutput(
                    stage, handoff=payload, finished=last, finish_reason=FinishReason.STOP if last else None
                )
            return
        codes = request.handoff.tensors["codes"]
        audio = np.full(240 * int(codes[0]), 0.25, np.float32)
        yield StageOutput(stage, audio=audio, sample_rate=24000, finished=True, usage=Usage(prompt_tokens=4))


class FakeView:
    """Serve's view of the application, as the ingress reads it (every stage running)."""

    def __init__(self, app_name: str, stages: dict[str, str]):
        self.stages = stages

    def http_options(self) -> SimpleNamespace:
        return SimpleNamespace(host="127.0.0.1", request_timeout_s=60.0)  # Serve's HTTPOptions: a loopback server

    async def stage_states(self) -> dict[str, str]:
        return dict.fromkeys(self.stages, "ready")
