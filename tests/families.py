"""The model families omni_serve serves end to end in CI: the graph each deploys and the request that runs every stage.

A family added here (and marked "served end to end in CI" in docs/models.md, which tests/test_graphs_generator.py
checks) is held to every graph property of :mod:`tests.graph_properties` by its integration module, which runs
``graph_properties.PROPERTIES`` on its deployed graph (tests/test_graph_properties.py checks that each does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    graph: str  # the graph file its tests deploy (graphs/)
    module: str  # the integration module that deploys it and runs graph_properties.PROPERTIES on it
    route: str  # the route a request reaching every stage takes
    # A request reaching every stage (``long``: one that runs for minutes unless cancelled, so a client
    # that leaves does so mid-request).
    body: Callable[[bool], dict[str, Any]]
    pipeline: str | None = None  # its vLLM-Omni pipeline, for the vllm_omni families
    # The route creates a job (``/v1/videos``): a request is the job made, waited for, downloaded and deleted,
    # and a client that leaves is one that deletes its job (a job outlives its HTTP call by design).
    jobs: bool = False


def omni_chat(model: str, talker: str = "talker") -> Callable[[bool], dict[str, Any]]:
    """A chat request with spoken audio; long: the talker asked for 4000 greedy codec frames (a tiny random
    talker never samples its codec EOS greedily)."""

    def body(long: bool) -> dict[str, Any]:
        frames = 4000 if long else 8
        return {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "modalities": ["text", "audio"],
            "max_tokens": 8,
            "seed": 7,
            "stage_sampling": {talker: {"temperature": 0.0, "max_tokens": frames}},
        }

    return body


def tts_speech(model: str, voice: str, entry: str) -> Callable[[bool], dict[str, Any]]:
    """A speech request (the entry stage hands the codec stage its codes in chunks as it decodes); long: the entry
    stage made to run 900 frames (``min_tokens``: a tiny one samples its end within a few frames otherwise) and
    ``stream``, so the reply starts at the first audio; short: 8 frames at most, the status at the entry's end."""

    def body(long: bool) -> dict[str, Any]:
        talker = {"min_tokens": 900, "max_tokens": 900} if long else {"max_tokens": 8}
        return {
            "model": model,
            "input": "Tell me a long story.",
            "voice": voice,
            "response_format": "pcm",
            "stream": long,
            "stage_sampling": {entry: talker},
        }

    return body


def text_handoff_chat(model: str) -> Callable[[bool], dict[str, Any]]:
    """A chat request with spoken audio, for a talker that speaks the thinker's whole text (Ming-flash-omni: no
    chunked handoff); long: 300 text tokens, which the talker takes tens of seconds to speak in one engine step."""

    def body(long: bool) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "modalities": ["text", "audio"],
            "max_tokens": 300 if long else 8,
            "seed": 7,
        }

    return body


def text_chat(model: str, long_tokens: int) -> Callable[[bool], dict[str, Any]]:
    """A text chat (a thinker alone); long: ``long_tokens`` tokens, all of them (``min_tokens``), seconds of decode."""

    def body(long: bool) -> dict[str, Any]:
        tokens = {"max_tokens": long_tokens, "min_tokens": long_tokens} if long else {"max_tokens": 8}
        return {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}], "seed": 7, **tokens}

    return body


def image_generation(model: str) -> Callable[[bool], dict[str, Any]]:
    """An image request (an AR stage plans, a DiT draws); long: 256x256 in 100 denoising steps, which keeps the DiT
    drawing for seconds after the AR's part."""

    def body(long: bool) -> dict[str, Any]:
        size, steps = ("256x256", 100) if long else ("64x64", 2)
        return {"model": model, "prompt": "a red fox", "size": size, "num_inference_steps": steps, "seed": 7}

    return body


def video_job(model: str, size: str, frames: int) -> Callable[[bool], dict[str, Any]]:
    """A text-to-video job; long: 200 denoising steps (the most a job may ask), seconds of the DiT's work."""

    def body(long: bool) -> dict[str, Any]:
        steps = 200 if long else 2
        return {"model": model, "prompt": "a red fox", "size": size, "num_frames": frames, "num_inference_steps": steps}

    return body


FAMILIES = (
    Family("transformers", "tiny_omni.yaml", "test_cancellation", "/v1/chat/completions", omni_chat("tiny-qwen3-omni")),
    Family(
        "vllm_omni.qwen3_omni_moe",
        "tiny_omni_vllm.yaml",
        "test_vllm_omni_cpu",
        "/v1/chat/completions",
        omni_chat("tiny-qwen3-omni"),
        pipeline="qwen3_omni_moe",
    ),
    Family(
        "vllm_omni.qwen3_tts",
        "tiny_qwen3_tts_vllm_omni.yaml",
        "test_qwen3_tts_cpu",
        "/v1/audio/speech",
        tts_speech("tiny-qwen3-tts", "vivian", "qwen3_tts"),
        pipeline="qwen3_tts",
    ),
    Family(
        "vllm_omni.voxtral_tts",
        "tiny_voxtral_tts_vllm_omni.yaml",
        "test_voxtral_tts_cpu",
        "/v1/audio/speech",
        tts_speech("tiny-voxtral-tts", "casual_male", "audio_generation"),
        pipeline="voxtral_tts",
    ),
    Family(
        "vllm_omni.ming_flash_omni",
        "tiny_ming_flash_omni_vllm_omni.yaml",
        "test_ming_flash_omni_cpu",
        "/v1/chat/completions",
        text_handoff_chat("tiny-ming-flash-omni"),
        pipeline="ming_flash_omni",
    ),
    Family(
        "vllm_omni.qwen3_omni_moe_thinker_only",
        "tiny_qwen3_omni_thinker_vllm_omni.yaml",
        "test_thinker_only_cpu",
        "/v1/chat/completions",
        text_chat("tiny-qwen3-omni", 900),
        pipeline="qwen3_omni_moe_thinker_only",
    ),
    Family(
        "vllm_omni.ming_flash_omni_thinker_only",
        "tiny_ming_flash_omni_thinker_vllm_omni.yaml",
        "test_thinker_only_cpu",
        "/v1/chat/completions",
        text_chat("tiny-ming-flash-omni", 1800),
        pipeline="ming_flash_omni_thinker_only",
    ),
    Family(
        "vllm_omni.qwen2_5_omni",
        "tiny_qwen2_5_omni_vllm_omni.yaml",
        "test_qwen2_5_omni_cpu",
        "/v1/chat/completions",
        omni_chat("tiny-qwen2.5-omni"),
        pipeline="qwen2_5_omni",
    ),
    Family(
        "vllm_omni.qwen2_5_omni_thinker_only",
        "tiny_qwen2_5_omni_thinker_vllm_omni.yaml",
        "test_thinker_only_cpu",
        "/v1/chat/completions",
        text_chat("tiny-qwen2.5-omni", 1800),
        pipeline="qwen2_5_omni_thinker_only",
    ),
    Family(
        "vllm_omni.wan2_2_ti2v",
        "tiny_video.yaml",
        "test_videos",
        "/v1/videos",
        video_job("tiny-wan2.2-ti2v", "64x32", 9),
        pipeline="wan2_2_ti2v",
        jobs=True,
    ),
    Family(
        "vllm_omni.hunyuan_video_15",
        "tiny_hunyuan_video_15.yaml",
        "test_hunyuan_video_cpu",
        "/v1/videos",
        video_job("tiny-hunyuan-video-1.5", "48x32", 9),
        pipeline="hunyuan_video_15",
        jobs=True,
    ),
    Family(
        "vllm_omni.glm_image",
        "tiny_glm_image_vllm_omni.yaml",
        "test_glm_image_cpu",
        "/v1/images/generations",
        image_generation("tiny-glm-image"),
        pipeline="glm_image",
    ),
)
BY_NAME = {family.name: family for family in FAMILIES}
