"""Structured outputs for the transformers family: the constraint compiled by xgrammar, applied in HF ``generate``.

``response_format``, a forced tool call and vLLM's ``structured_outputs`` are vLLM engine features;
the transformers family builds them from the piece vLLM's engines use by default: xgrammar compiles
the constraint against the model's tokenizer with vLLM's settings (JSON with any whitespace, choices
as an EBNF alternation, regexes, EBNF grammars, structural tags), and :func:`grammar_processor` turns
the compiled grammar into an HF logits processor that masks each step's logits before temperature,
top-k and top-p (HF runs a caller's processors after its own penalties and before its warpers; vLLM
applies its bitmask before sampling too). Once the grammar is complete only the model's end tokens
remain allowed; after one of them (``ignore_eos`` going on) nothing is masked any more, as in vLLM.

The compiled grammars are cached (a client repeating a schema or a tool set compiles it once) in a cache
bounded in bytes, as vLLM bounds its own: xgrammar's cache is unbounded by default, so each request with a
new schema would grow the replica for good. The bound is vLLM's setting, ``VLLM_XGRAMMAR_CACHE_MB`` (its
default, 512 MiB), so one number bounds the cache of both engine families; past it xgrammar evicts the
least recently used grammars.

A grammar is compiled off the engine's worker thread (:meth:`GrammarCompiler.submit`, on a thread of its own),
as vLLM's structured-output manager compiles in a thread pool while the scheduler keeps the request waiting
for it (``WAITING_FOR_FSM``) and steps the others: a request with a new schema waits for its grammar, while
the requests before and after it decode. On the worker, a compile of a large schema against a full vocabulary
(a second or more) held up every other request's steps.

xgrammar ships with vLLM (it is not a dependency of omni_serve): without it, structured outputs are
refused with a 400 naming the field (:func:`grammar_available`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from omni_serve.exceptions import InvalidStageInput
from omni_serve.types import StructuredOutputs

# vLLM's default for VLLM_XGRAMMAR_CACHE_MB (vllm/envs.py).
DEFAULT_CACHE_MB = 512


def cache_limit_bytes() -> int:
    """The compiled-grammar cache's bound: ``VLLM_XGRAMMAR_CACHE_MB`` MiB, as vLLM's xgrammar backend sets it."""
    return int(os.environ.get("VLLM_XGRAMMAR_CACHE_MB", DEFAULT_CACHE_MB)) * 1024 * 1024


def grammar_available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


class GrammarCompiler:
    """xgrammar's compiler for one model's tokenizer, built on first use (it reads the whole vocabulary once),
    and its compiled grammars cached, as vLLM keeps them: at most ``limit_bytes`` (default
    :func:`cache_limit_bytes`)."""

    def __init__(self, tokenizer: Any, vocab_size: int, limit_bytes: int | None = None):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.limit_bytes = cache_limit_bytes() if limit_bytes is None else limit_bytes
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")  # never the engine's

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_enabled=True, cache_limit_bytes=self.limit_bytes
                )
            return self._compiler

    def cache_bytes(self) -> int:
        """What the cached compiled grammars hold now (0 before the first compile)."""
        return 0 if self._compiler is None else int(self._compiler.get_cache_size_bytes())

    def submit(self, spec: StructuredOutputs, param: str) -> Future:
        """:meth:`compile` on the compiler's own thread: the compiled grammar, or the 400, comes in the future."""
        return self._thread.submit(self.compile, spec, param)

    def compile(self, spec: StructuredOutputs, param: str) -> Any:
        """The compiled grammar of ``spec``; a constraint xgrammar refuses is a 400 naming ``param``."""
        compiler = self._get()
        kind = spec.kind()
        try:
            if kind == "json":
                return compiler.compile_json_schema(json.dumps(spec.json_schema), any_whitespace=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice or []))
            if kind == "grammar":
                return compiler.compile_grammar(spec.grammar)
            return compiler.compile_structural_tag(spec.structural_tag)
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar's errors on an invalid constraint
            raise InvalidStageInput(f"{param}: the constraint does not compile: {err}", param) from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (vLLM's ``choice`` rule)."""
    escaped = ('"' + c.replace("\\", "\\\\").replace('"', '\\"') + '"' for c in choices)
    return "root ::= " + " | ".join(escaped)


def grammar_processor(compiled: Any, end_ids: list[int]) -> Any:
    """An HF logits processor that lets through only the tokens ``compiled`` accepts next (batch of one)."""
    import xgrammar as xgr
    from transformers import LogitsProcessor

    from omni_serve.exceptions import EngineError

    class _Grammar(LogitsProcessor):
        def __init__(self) -> None:
            self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=end_ids or None)
            self.mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
            self.started = False

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if self.started and not self.matcher.is_terminated():
                token = int(input_ids[0, -1])
                if not self.matcher.accept_token(token):  # the mask allowed it: a bug, never bad input
                    raise EngineError(f"the grammar refused token {token} it had allowed")
            self.started = True
            if self.matcher.is_terminated():  # an end token was sampled and ignored (ignore_eos): free from here
                return scores
            self.matcher.fill_next_token_bitmask(self.mask)
            xgr.apply_token_bitmask_inplace(scores, self.mask.to(scores.device), vocab_size=scores.shape[-1])
            return scores

    return _Grammar()
