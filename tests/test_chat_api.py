"""The tiny CPU graph end to end: real Ray cluster, `serve run graphs/tiny_omni.yaml`, real HTTP, official client."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from omni_serve.models.qwen3_omni import SAMPLE_RATE

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Say hello."}]
AUDIO = {"voice": None, "format": "wav"}


@pytest.fixture(scope="module")
def client(tiny_omni) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_omni.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def stage_calls(graphs, stage: str) -> int:
    return graphs.handle(stage).stats.remote().result()["calls"]


def decode_wav(b64: str) -> tuple[np.ndarray, int, int]:
    data, rate = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32", always_2d=True)
    return data[:, 0], rate, data.shape[1]


def test_models_and_health(tiny_omni) -> None:
    assert httpx.get(f"{tiny_omni.base_url}/health").json()["stages"] == {
        "thinker": "ready",
        "talker": "ready",
        "code2wav": "ready",
    }
    models = httpx.get(f"{tiny_omni.base_url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny-qwen3-omni"
    assert models["data"][0]["modalities"] == ["audio", "text"]


def test_haproxy_sends_the_requests_to_the_ingress_replica(tiny_omni) -> None:
    """The session cluster runs Serve's HAProxy ingress (as `make serve`'s): HAProxy hands each request to the
    ingress replica's own HTTP server, never to the head node's proxy (HAProxy's backup server)."""
    from tests.haproxy import served_by_ingress_replicas

    body = {"model": "tiny-qwen3-omni", "messages": MESSAGES, "max_tokens": 2, "modalities": ["text"]}
    served_by_ingress_replicas(lambda: httpx.post(f"{tiny_omni.base_url}/v1/chat/completions", json=body, timeout=120))


def test_text_only_skips_talker_and_code2wav(tiny_omni, client: openai.OpenAI) -> None:
    before = {s: stage_calls(tiny_omni, s) for s in ("thinker", "talker", "code2wav")}
    reply = client.chat.completions.create(model="tiny-qwen3-omni", messages=MESSAGES, max_tokens=8, seed=1)
    after = {s: stage_calls(tiny_omni, s) for s in ("thinker", "talker", "code2wav")}
    assert reply.choices[0].message.content
    assert reply.choices[0].message.audio is None
    assert reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 0
    assert after["thinker"] == before["thinker"] + 1
    assert after["talker"] == before["talker"] and after["code2wav"] == before["code2wav"]


def test_text_and_audio_non_streaming(tiny_omni, client: openai.OpenAI) -> None:
    before = stage_calls(tiny_omni, "talker")
    reply = client.chat.completions.create(
        model="tiny-qwen3-omni", messages=MESSAGES, modalities=["text", "audio"], audio=AUDIO, max_tokens=8, seed=3
    )
    message = reply.choices[0].message
    samples, rate, channels = decode_wav(message.audio.data)
    assert (rate, channels) == (SAMPLE_RATE, 1)
    assert samples.size > 0 and np.isfinite(samples).all()
    assert message.audio.transcript == message.content
    assert message.audio.id and message.audio.expires_at > 0
    assert stage_calls(tiny_omni, "talker") == before + 1


def test_ingress_never_deserializes_a_handoff_payload(tiny_omni, client: openai.OpenAI) -> None:
    client.chat.completions.create(
        model="tiny-qwen3-omni", messages=MESSAGES, modalities=["text", "audio"], audio=AUDIO, max_tokens=6, seed=4
    )
    # The check can fail: the stages behind it did load payloads, the ingress must not have.
    talker_loads = tiny_omni.handle("talker").stats.remote().result()["payload_loads"]
    code2wav_loads = tiny_omni.handle("code2wav").stats.remote().result()["payload_loads"]
    assert sum(talker_loads.values()) > 0 and sum(code2wav_loads.values()) > 0
    assert tiny_omni.handle("ingress").payload_loads.remote().result() == {}


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_streaming_text_and_audio(tiny_omni) -> None:
    body = {
        "model": "tiny-qwen3-omni",
        "messages": MESSAGES,
        "modalities": ["text", "audio"],
        "audio": AUDIO,
        "max_tokens": 8,
        "seed": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{tiny_omni.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    kinds = []
    for c in chunks[1:]:
        if not c["choices"]:
            kinds.append("usage")
        elif c["choices"][0]["finish_reason"]:
            kinds.append("finish")
        else:
            kinds.append(c["modality"])
    # Text and audio interleave as produced; finish, then usage close the stream.
    assert kinds[-2:] == ["finish", "usage"]
    assert "text" in kinds and "audio" in kinds
    assert kinds.index("text") < kinds.index("audio")
    audio = [decode_wav(c["choices"][0]["delta"]["audio"]["data"]) for c in chunks[1:] if c.get("modality") == "audio"]
    assert all(rate == SAMPLE_RATE and ch == 1 and s.size > 0 for s, rate, ch in audio)
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    # Same request, not streamed, same seed: same text and the same audio.
    whole = httpx.post(f"{tiny_omni.base_url}/v1/chat/completions", json={**body, "stream": False}, timeout=120).json()
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:] if c.get("modality") == "text")
    assert text == whole["choices"][0]["message"]["content"]
    streamed = np.concatenate([s for s, _, _ in audio])
    full, _, _ = decode_wav(whole["choices"][0]["message"]["audio"]["data"])
    assert streamed.shape == full.shape and np.allclose(streamed, full, atol=1e-3)


def test_openai_client_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny-qwen3-omni", messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_openai_client_streaming_with_vllms_continuous_usage(client: openai.OpenAI) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk's ``usage`` is the count so far."""
    kwargs = {"model": "tiny-qwen3-omni", "messages": MESSAGES, "modalities": ["text", "audio"], "audio": AUDIO}
    kwargs |= {"max_tokens": 8, "seed": 9}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options=options))
    assert all(c.usage is not None for c in chunks)
    whole = client.chat.completions.create(**kwargs).usage  # same seed: the same generation
    assert chunks[-1].usage == whole and not chunks[-1].choices
    assert {c.usage.prompt_tokens for c in chunks} == {whole.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == whole.completion_tokens
    # Each text chunk brings at least one new token; audio chunks repeat the text stage's count so far.
    text = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert text and text == sorted(set(text))
    assert any(getattr(c, "modality", None) == "audio" for c in chunks)


def test_concurrent_requests_with_different_seeds(client: openai.OpenAI) -> None:
    def ask(seed: int) -> tuple[str, str]:
        reply = client.chat.completions.create(
            model="tiny-qwen3-omni",
            messages=MESSAGES,
            modalities=["text", "audio"],
            audio=AUDIO,
            max_tokens=12,
            seed=seed,
            temperature=1.0,
            top_p=1.0,
            # 16 codec frames, not the graph's 32: the talker's sampling still follows the seed on every frame,
            # and four spoken replies cost half the CPU-seconds.
            extra_body={"top_k": 0, "stage_sampling": {"talker": {"max_tokens": 16}}},
        )
        return reply.choices[0].message.content, reply.choices[0].message.audio.data

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        concurrent_a, concurrent_b = pool.map(ask, [11, 12])
    assert concurrent_a != concurrent_b
    # Concurrency did not leak state between requests: each matches its seed run alone.
    assert ask(11) == concurrent_a
    assert ask(12) == concurrent_b


def test_malformed_request_gets_400_and_server_stays_healthy(tiny_omni) -> None:
    url = f"{tiny_omni.base_url}/v1/chat/completions"
    cases = [
        ({"model": "tiny-qwen3-omni", "messages": "hi"}, "messages"),
        ({"model": "tiny-qwen3-omni", "messages": MESSAGES, "max_tokens": -3}, "max_tokens"),
        ({"model": "tiny-qwen3-omni", "messages": MESSAGES, "modalities": ["smell"]}, "modalities"),
        ({"model": "tiny-qwen3-omni", "messages": MESSAGES, "audio": {"format": "ogg"}}, "audio.format"),
        ({"model": "tiny-qwen3-omni", "messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"model": "tiny-qwen3-omni", "messages": MESSAGES, "stage_sampling": {"narrator": {}}}, "stage_sampling"),
    ]
    for body, field in cases:
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert field in error["message"] and error["param"].startswith(field.split(".")[0]), error
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    wrong_model = httpx.post(url, json={"model": "gpt-9", "messages": MESSAGES}, timeout=30)
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"

    assert httpx.get(f"{tiny_omni.base_url}/health", timeout=30).status_code == 200
    ok = httpx.post(url, json={"model": "tiny-qwen3-omni", "messages": MESSAGES, "max_tokens": 4}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
