"""Drop-in compatibility with vLLM-Omni's and OpenAI's clients, over real HTTP on the tiny graph.

vLLM-Omni's own Qwen3-Omni example client (examples/online_serving/qwen3_omni/
openai_chat_completion_client_for_multimodal_generation.py) sends ``sampling_params_list``
(one vLLM SamplingParams dict per stage, by position), ``speaker`` and ``modalities`` through
the official client's ``extra_body``; OpenAI clients send voices such as ``alloy``. vLLM-Omni's
benchmark client (``vllm-omni bench serve --omni --backend openai-chat-omni``) runs unmodified
against the graph: it streams with vLLM's ``stream_options.continuous_usage_stats``, and, with tpot or
itl named among its metrics, sends vLLM-Omni's ``return_stage_metrics``.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from omni_serve.models.qwen3_omni import SAMPLE_RATE
from tests.benchmark_client import BENCH_PROMPTS, MODEL, SEED, run_benchmark_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(tiny_omni) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_omni.base_url}/v1", api_key="EMPTY", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def http(tiny_omni) -> httpx.Client:
    with httpx.Client(base_url=tiny_omni.base_url, timeout=120) as http:
        yield http


def vllm_omni_example_request() -> dict[str, Any]:
    """The example client's request for ``--query-type text --modalities text,audio --speaker Ethan``, verbatim
    but for its lengths: a random tiny model seldom samples EOS, and the example's 16384 thinker and 4096 talker
    tokens ran the CPU engines to their limits (45 s of a test run for one reply); every field and its type stays."""
    thinker = {
        "temperature": 0.4,
        "top_p": 0.9,
        "top_k": 1,
        "max_tokens": 24,  # the example: 16384
        "repetition_penalty": 1.05,
        "stop_token_ids": [151645],  # Qwen EOS token <|im_end|>
        "seed": SEED,
    }
    talker = {
        "temperature": 0.9,
        "top_k": 50,
        "max_tokens": 32,  # the example: 4096
        "seed": SEED,
        "detokenize": False,
        "repetition_penalty": 1.05,
        "stop_token_ids": [2150],  # TALKER_CODEC_EOS_TOKEN_ID
    }
    code2wav = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 32 * 16,  # the example: 4096 * 16
        "seed": SEED,
        "detokenize": True,
        "repetition_penalty": 1.1,
    }
    system = (
        "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
        "auditory and visual inputs, as well as generating text and speech."
    )
    question = "Explain the system architecture for a scalable audio generation pipeline. Answer in 15 words."
    return {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": question}]},
        ],
        "model": MODEL,
        "modalities": ["text", "audio"],
        "extra_body": {"sampling_params_list": [thinker, talker, code2wav], "speaker": "Ethan"},
    }


def test_vllm_omni_example_client_request_gets_text_and_audio(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(**vllm_omni_example_request())
    message = reply.choices[0].message
    assert isinstance(message.content, str) and message.content
    samples, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    assert rate == SAMPLE_RATE and samples.size > 0 and np.isfinite(samples).all()
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


@pytest.mark.vllm_cpu
def test_vllm_omni_benchmark_client_with_stage_metrics(tiny_omni, tmp_path: Path) -> None:
    """Every request streams with ``stream_options: {include_usage, continuous_usage_stats}`` (a server refusing
    that field fails them all); with tpot/itl named in ``--percentile-metrics`` and ``--print-stage``, the client
    also sends vLLM-Omni's ``return_stage_metrics`` and reads each stage's metrics from the chunks' ``metrics``.
    One run: without those options the client only leaves the field out (a stream not asking for it gets none:
    test_stage_metrics_match_the_reply)."""
    metrics = "ttft,tpot,itl,e2el,audio_ttfp,audio_rtf"
    options = ("--percentile-metrics", metrics, "--print-stage")
    result, printed = run_benchmark_client(tiny_omni.base_url, tmp_path, *options)
    assert result["num_audio_ttfp_samples"] == result["num_audio_rtf_samples"] == BENCH_PROMPTS, printed
    assert result["mean_audio_ttfp_ms"] > 0 and result["mean_audio_rtf"] > 0, printed
    assert result["num_tpot_samples"] > 0 and result["num_itl_samples"] > 0, printed
    assert result["num_ttft_samples"] == BENCH_PROMPTS and result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0
    # Per request, the fields the client keeps of each stage's entry (thinker 0, talker 1, code2wav 2).
    per_request = result["request_stage_metrics"]
    assert len(per_request) == BENCH_PROMPTS and all(set(r) == {"0", "1", "2"} for r in per_request), per_request
    for stages, generated in zip(per_request, result["output_lens"], strict=True):
        assert stages["0"]["num_tokens_out"] == generated and stages["0"]["finish_reason"] in ("stop", "length")
        assert stages["1"]["num_tokens_out"] > 0  # the talker's codec frames
        assert stages["2"]["audio_frames"] > 0 and stages["2"]["audio_duration_s"] > 0
    # The audio the server counted per stage is the audio the client decoded from the chunks.
    counted = sum(stages["2"]["audio_duration_s"] for stages in per_request)
    assert counted == pytest.approx(result["total_audio_duration_s"], abs=1e-6), (counted, printed)
    # The client's per-stage report, built from those entries.
    assert "Stage Benchmark Result" in printed, printed
    for title in ("Stage 0 (thinker)", "Stage 1 (talker)", "Stage 2 (code2wav)"):
        assert title in printed, printed


def _chat(http: httpx.Client, **body: Any) -> httpx.Response:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "seed": 7}
    return http.post("/v1/chat/completions", json={**base, **body})


AUDIO = {"modalities": ["text", "audio"], "stage_sampling": {"talker": {"max_tokens": 8}}}


def _audio_of(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["audio"]["data"]


def test_stage_metrics_match_the_reply(http: httpx.Client) -> None:
    """vLLM-Omni's ``return_stage_metrics`` on a non-streamed reply: every stage that ran, counted as the reply is."""
    reply = _chat(http, return_stage_metrics=True, audio={"format": "wav"}, **AUDIO)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    stages = body["metrics"]["stage_metrics"]
    assert [(sid, s["stage_name"], s["final_output_type"]) for sid, s in stages.items()] == [
        ("0", "thinker", "text"), ("1", "talker", None), ("2", "code2wav", "audio"),
    ]  # fmt: skip
    thinker, talker, code2wav = stages.values()
    assert (thinker["num_tokens_in"], thinker["num_tokens_out"]) == (
        body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"],
    )  # fmt: skip
    assert thinker["finish_reason"] == body["choices"][0]["finish_reason"]
    samples, rate = sf.read(io.BytesIO(base64.b64decode(_audio_of(reply))))
    assert code2wav["audio_frames"] == len(samples) and code2wav["audio_sample_rate"] == rate == SAMPLE_RATE
    # The talker's codec frames (at most its max_tokens) are the frames code2wav decoded, over all its calls.
    assert 0 < talker["num_tokens_out"] <= 8 and code2wav["num_tokens_in"] == talker["num_tokens_out"]
    for stage in stages.values():  # each stage starts after the request arrived and answers after it starts
        assert 0 < stage["serving_time_to_first_output_ms"] and 0 < stage["stage_gen_time_ms"]
    assert thinker["serving_time_to_first_output_ms"] < code2wav["serving_time_to_first_output_ms"]
    # The top level repeats the last output's stage (code2wav), as vLLM-Omni does.
    assert (body["metrics"]["stage_id"], body["metrics"]["final_output_type"]) == (2, "audio")
    assert "metrics" not in _chat(http, **AUDIO).json()  # not asked for
    # Nor on a stream not asking for them (the benchmark client's stream when no tpot/itl metric is named).
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "seed": 7, **AUDIO}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": options}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and events and all("metrics" not in e for e in events), events[-1:]


def test_voices_are_listed_and_openai_names_are_aliases(http: httpx.Client) -> None:
    listed = http.get("/v1/audio/voices").json()
    card = http.get("/v1/models").json()["data"][0]
    assert listed["voices"] == card["voices"] and set(listed["voices"]) >= {"chelsie", "ethan"}
    assert listed["aliases"] == card["voice_aliases"] and listed["aliases"]["alloy"] in listed["voices"]
    target = listed["aliases"]["alloy"]
    # Same seed: an alias speaks exactly as the voice it names, and another voice differs.
    alias = _audio_of(_chat(http, audio={"voice": "alloy", "format": "wav"}, **AUDIO))
    named = _audio_of(_chat(http, audio={"voice": target.title(), "format": "wav"}, **AUDIO))
    other = next(v for v in listed["voices"] if v != target)
    assert alias == named != _audio_of(_chat(http, audio={"voice": other, "format": "wav"}, **AUDIO))
    # vLLM-Omni's top-level speaker / voice name the same voices.
    assert _audio_of(_chat(http, speaker=target, **AUDIO)) == named
    assert _audio_of(_chat(http, voice="ALLOY", **AUDIO)) == named


def test_unknown_voice_is_refused_before_any_stage_runs(tiny_omni, http: httpx.Client) -> None:
    thinker = tiny_omni.handle("thinker")
    before = thinker.stats.remote().result()["requests_total"]
    for body, param in [
        ({"audio": {"voice": "nobody", "format": "wav"}}, "audio.voice"),
        ({"speaker": "nobody"}, "speaker"),
    ]:
        reply = _chat(http, **AUDIO, **body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "'nobody'" in error["message"] and "chelsie" in error["message"]
    for field in ("voice", "speaker"):  # vLLM-Omni's speech request takes either name
        speech = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi", field: "nobody"})
        assert speech.status_code == 400 and speech.json()["error"]["param"] == "voice"
    conflict = _chat(http, **AUDIO, audio={"voice": "ethan", "format": "wav"}, speaker="chelsie")
    assert conflict.status_code == 400 and "different voices" in conflict.json()["error"]["message"]
    assert thinker.stats.remote().result()["requests_total"] == before  # no stage saw any of them


def test_audio_only_reply_reports_usage_transcript_and_finish(http: httpx.Client) -> None:
    body = {"modalities": ["audio"], "audio": {"voice": "ethan", "format": "wav"}, "max_tokens": 6, "seed": 5}
    body["stage_sampling"] = {"talker": {"max_tokens": 8}}
    reply = _chat(http, **body)
    assert reply.status_code == 200, reply.text
    choice, usage = reply.json()["choices"][0], reply.json()["usage"]
    assert choice["message"]["content"] is None and choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["audio"]["transcript"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The same request as text+audio says the same words with the same usage.
    both = _chat(http, **{**body, "modalities": ["text", "audio"]}).json()
    assert both["choices"][0]["message"]["content"] == choice["message"]["audio"]["transcript"]
    assert both["usage"] == usage

    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, **body}
        | {"stream_options": {"include_usage": True}},
    ) as stream:
        assert stream.status_code == 200
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    transcript = "".join(
        c["choices"][0]["delta"].get("audio", {}).get("transcript", "") for c in chunks if c["choices"]
    )
    assert transcript == choice["message"]["audio"]["transcript"]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"] and c.get("modality"))
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [choice["finish_reason"]]
    assert chunks[-1]["usage"] == usage


def test_vllm_omni_extensions(http: httpx.Client) -> None:
    accepted = _chat(
        http,
        mm_processor_kwargs={"use_audio_in_video": True},
        language="en",
        instructions="Speak calmly.",
        return_prompt_text=True,
    )
    assert accepted.status_code == 200, accepted.text
    assert "<|im_start|>user" in accepted.json()["prompt_text"] and "Hi" in accepted.json()["prompt_text"]
    # sampling_params_list is positional over the graph's stage order; each entry names its field.
    too_many = _chat(http, sampling_params_list=[{}, {}, {}, {}])
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "sampling_params_list"
    # vLLM's min_p is honoured by the thinker, not by the transformers talker: refused by its path.
    unhonoured = _chat(http, sampling_params_list=[{}, {"min_p": 0.1}])
    assert unhonoured.status_code == 400, unhonoured.text
    assert unhonoured.json()["error"]["param"] == "sampling_params_list.1.min_p"
    assert "cannot honour" in unhonoured.json()["error"]["message"]
    bad = _chat(http, sampling_params_list=[{"temperature": 9}])
    assert bad.json()["error"]["param"] == "sampling_params_list.0.temperature"
    both = _chat(http, sampling_params_list=[{}], stage_sampling={"thinker": {}})
    assert both.status_code == 400 and "one" in both.json()["error"]["message"]
    # The positional form is the named form: same seed, same tokens.
    named = _chat(http, stage_sampling={"thinker": {"temperature": 1.0, "max_tokens": 6}}).json()
    positional = _chat(http, sampling_params_list=[{"temperature": 1.0, "max_tokens": 6}]).json()
    assert named["choices"][0]["message"]["content"] == positional["choices"][0]["message"]["content"]


def test_request_id_is_echoed_but_never_reused(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    first, second = (http.post("/v1/chat/completions", json=body, headers={"x-request-id": "label"}) for _ in "12")
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "label"
    ids = {first.json()["id"], second.json()["id"]}
    assert len(ids) == 2 and "label" not in "".join(ids)  # the server mints the completion id
