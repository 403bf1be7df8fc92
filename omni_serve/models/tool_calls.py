"""Tool calls in the entry stage's output, parsed as it decodes with the model family's vLLM tool parser.

The entry stage (the thinker) parses its own output rather than the ingress, for one reason: it
decides what the next stage hears. A reply that calls a tool must not be spoken, and a reply with
text and a call speaks only the text, so the rows the thinker hands the talker stop where the text
the client sees stops. Only the stage knows which tokens those are as it decodes; it asks
:attr:`ToolCallStream.spoken` after each step and withholds the rest (each engine family's thinker
does the withholding on its own handoff). Whoever runs the entry stage (chat, the Realtime API)
then gets the calls as :class:`~omni_serve.types.ToolCallDelta` outputs beside the text.

The parsing is vLLM's own, as ``vllm serve --enable-auto-tool-choice --tool-call-parser NAME`` does
it (``vllm.parser.ParserManager``: the tool parser of the model family, Qwen's ``hermes``): the
request's tools go through the parser's ``adjust_request``, which forces a call for ``tool_choice``
``required`` or a named function with a structured-output constraint on the thinker (a structural
tag for parsers that have one), and every engine step's text goes through ``parse_delta``. So the
same tools give the same calls as native vLLM on the same tokens. vLLM is imported when a parser is
first loaded (:class:`ParserLoader`), never at import of this module.

Where omni_serve differs from ``vllm serve``: ``parallel_tool_calls: false`` is also put into the
forcing constraint (a ``required`` choice stops after its first call instead of generating more
calls that are then dropped), and ``finish_reason`` stays ``length`` when a call was cut short.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from pydantic import Field

from omni_serve.exceptions import InvalidStageInput
from omni_serve.types import FinishReason, SamplingParams, StructuredOutputs, ToolCallDelta, ToolCalling


def tool_call_parser_field() -> Any:
    """The ``tool_call_parser`` engine arg of every engine family whose stage can be an entry stage."""
    return Field(
        None,
        description="vLLM's tool parser for the model's tool-call syntax (`vllm serve --tool-call-parser`; Qwen's "
        "is 'hermes'): tool calls are parsed from the entry stage's output with it. None: requests with tools "
        "are refused.",
    )


def load_parser(name: str) -> Any:
    """vLLM's parser class for the tool parser ``name`` (imports vLLM; raises ``ValueError`` for an unknown name)."""
    from vllm.parser import ParserManager
    from vllm.tool_parsers import ToolParserManager

    known = ToolParserManager.list_registered()
    if name not in known:
        raise ValueError(f"'{name}' is not one of vLLM's tool parsers ({', '.join(known)})")
    return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True)


class ParserLoader:
    """A stage's tool parser, loaded on a thread of its own when the first request with tools asks for it.

    Importing vLLM's parsers takes seconds (24 s on the loaded 2-core test machine) and ~150 MB: a
    stage that does not otherwise import vLLM (the transformers family) pays that only once a request
    needs it, and that request waits for :meth:`future` meanwhile (the stage's other requests do not).
    """

    def __init__(self, name: str):
        self.name = name
        self._loaded: Future[Any] | None = None
        self._lock = threading.Lock()

    def future(self) -> Future[Any]:
        with self._lock:
            if self._loaded is None:
                self._loaded = Future()
                threading.Thread(
                    target=self._load, args=(self._loaded,), name=f"tool-parser-{self.name}", daemon=True
                ).start()
            return self._loaded

    def _load(self, loaded: Future[Any]) -> None:
        try:
            loaded.set_result(load_parser(self.name))
        except BaseException as err:  # ImportError without vLLM, ValueError for an unknown name
            loaded.set_exception(err)


def parser_or_refuse(loaded: Any, stage: str, name: str | None) -> Any:
    """The parser class from a loader's result, or a 400 naming ``tools`` saying why tools cannot be honoured."""
    if name is None:
        raise InvalidStageInput(
            f"tools: stage '{stage}' has no tool parser (engine_args.tool_call_parser), so tool calls cannot be "
            "parsed from its output",
            "tools",
        )
    if isinstance(loaded, BaseException):
        reason = "vLLM is not installed" if isinstance(loaded, ImportError) else str(loaded)
        raise InvalidStageInput(f"tools: stage '{stage}' cannot load tool parser '{name}' ({reason})", "tools")
    return loaded


class ToolCallStream:
    """One request's tool calls, parsed from its entry stage's output step by step.

    :meth:`push` takes each engine step's text delta and token ids and returns the text the client
    sees (the reply without its calls) and the calls' pieces. :attr:`spoken` is how many generated
    tokens lie wholly inside that text so far: what the talker may speak. It only grows, and stops
    for good where the client's text stops following the model's text (a call began).
    """

    def __init__(self, parser_cls: Any, tokenizer: Any, calling: ToolCalling):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        choice: Any = calling.choice
        if calling.function is not None:
            choice = {"type": "function", "function": {"name": calling.function}}
        request = ChatCompletionRequest(
            messages=[], model="", tools=calling.tools, tool_choice=choice, parallel_tool_calls=calling.parallel
        )
        self.parser = parser_cls(tokenizer, request.tools)
        self.request = self.parser.adjust_request(request)
        self.calling = calling
        self.called = False
        self._unshown = ""  # the model's text after the part the client's text follows
        self._text_len = 0
        self._content_len = 0  # the client's text so far, while it is a prefix of the model's
        self._diverged = False
        self._marks: list[tuple[int, int]] = []  # (model text length, tokens) after each push
        self._tokens = 0
        self._spoken = 0

    def constrained(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` as the parser adjusted the request: a forced call's constraint (it replaces any
        ``response_format``, as in vLLM) and the parser's ``skip_special_tokens``."""
        update: dict[str, Any] = {}
        forced = self.request.structured_outputs
        if forced is not None:
            update["structured_outputs"] = _structured_outputs(forced, self.calling.parallel)
        if self.request.skip_special_tokens is False:
            update["skip_special_tokens"] = False
        return sampling.model_copy(update=update) if update else sampling

    def push(self, text: str, token_ids: Sequence[int], finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """One engine step: (the client's text of it, the calls' pieces it completed)."""
        if not text and not token_ids and not finished:
            return "", []
        # The prompt's ids only tell a reasoning parser whether reasoning ended in the prompt; none is
        # configured, and the parser leaves its tool phase shut until it has been given some.
        delta = self.parser.parse_delta(text, list(token_ids), self.request, prompt_token_ids=[], finished=finished)
        self._unshown += text
        self._text_len += len(text)
        self._tokens += len(token_ids)
        self._marks.append((self._text_len, self._tokens))
        content = (delta.content or "") if delta is not None else ""
        calls = [_delta(call) for call in (delta.tool_calls or [])] if delta is not None else []
        if not self.calling.parallel:  # parallel_tool_calls: false keeps the first call only (as vLLM)
            calls = [call for call in calls if call.index == 0]
        self.called = self.called or bool(calls)
        self._follow(content)
        return content, calls

    @property
    def spoken(self) -> int:
        return self._spoken

    def finish_reason(self, reason: FinishReason) -> FinishReason:
        """OpenAI's: ``tool_calls`` when the reply ended in calls, ``stop`` for a named ``tool_choice``; a reply
        cut short keeps ``length``."""
        if self.called and reason is FinishReason.STOP and self.calling.function is None:
            return FinishReason.TOOL_CALLS
        return reason

    def _follow(self, content: str) -> None:
        """Advance :attr:`spoken` by the client's new text, while it is the model's text from the start."""
        if self._diverged or not content:
            return
        if not self._unshown.startswith(content):
            self._diverged = True  # a parser that rewrites the text: what it shows cannot be tied to tokens
            return
        self._unshown = self._unshown[len(content) :]
        self._content_len += len(content)
        while self._marks and self._marks[0][0] <= self._content_len:
            self._spoken = self._marks.pop(0)[1]


def _delta(call: Any) -> ToolCallDelta:
    """vLLM's ``DeltaToolCall`` -> ours."""
    function = call.function
    name = getattr(function, "name", None) if function is not None else None
    arguments = getattr(function, "arguments", None) if function is not None else None
    if isinstance(function, dict):
        name, arguments = function.get("name"), function.get("arguments")
    return ToolCallDelta(index=call.index, id=call.id, name=name, arguments=arguments or "")


def _structured_outputs(params: Any, parallel: bool) -> StructuredOutputs:
    """vLLM's ``StructuredOutputsParams`` for a forced call -> ours; ``parallel`` False ends the constraint
    after the first call (a structural tag's ``stop_after_first``)."""
    import json

    tag = params.structural_tag
    if tag is not None:
        if not parallel:
            spec = json.loads(tag)
            fmt = spec.get("format")
            if isinstance(fmt, dict) and "stop_after_first" in fmt:
                fmt["stop_after_first"] = True
                tag = json.dumps(spec)
        return StructuredOutputs(structural_tag=tag)
    schema = params.json
    return StructuredOutputs.model_validate({"json": json.loads(schema) if isinstance(schema, str) else schema})


def merge_deltas(first: list[ToolCallDelta], later: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Two runs of consecutive call pieces as one run: a piece continuing the call before it joins it."""
    merged: list[ToolCallDelta] = []
    for piece in [*first, *later]:
        last = merged[-1] if merged else None
        if last is not None and last.index == piece.index and piece.id is None and piece.name is None:
            last.arguments += piece.arguments
        else:
            merged.append(ToolCallDelta(piece.index, piece.id, piece.name, piece.arguments))
    return merged


def tool_call_stream(
    calling: ToolCalling | None, loaded: Any, stage: str, name: str | None, tokenizer: Any
) -> ToolCallStream | None:
    """A request's tool-call parsing on a stage: None without tools or with ``tool_choice: none``, else a
    :class:`ToolCallStream` with the stage's parser (a 400 naming ``tools`` when the stage has none)."""
    if calling is None or calling.choice == "none":
        return None
    return ToolCallStream(parser_or_refuse(loaded, stage, name), tokenizer, calling)
