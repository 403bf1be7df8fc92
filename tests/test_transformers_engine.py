"""The transformers stage engines end to end, in process, on the tiny checkpoint (no Ray)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pydantic
import pytest

from omni_serve.engines import transformers as te
from omni_serve.engines.base import StageEngine
from omni_serve.engines.transformers import sampling
from omni_serve.engines.transformers.worker import MAX_UNTAKEN_OUTPUTS
from omni_serve.exceptions import InvalidStageInput
from omni_serve.models import codec
from omni_serve.models import qwen3_omni as q
from omni_serve.payload import HandoffPayload
from omni_serve.types import (
    MAX_TOKENS_LIMIT,
    ChatMessage,
    FinishReason,
    SamplingParams,
    StageOutput,
    StageRequest,
    ToolCalling,
)
from tests.hf_reference import hf_reference_generate
from tests.vocoder import hf_lag

HELLO = [ChatMessage(role="user", content="Hello there, how are you?")]
FIRST, CHUNK = 4, 5  # small codec chunks so short requests still stream several


@pytest.fixture(scope="module")
def engines() -> dict[str, StageEngine]:
    made = {
        "thinker": te.create("thinker", {"model_stage": "thinker"}),
        "talker": te.create(
            "talker", {"model_stage": "talker", "codec_first_chunk_frames": FIRST, "codec_chunk_frames": CHUNK}
        ),
        "code2wav": te.create("code2wav", {"model_stage": "code2wav"}),
    }

    async def start_all() -> None:
        for engine in made.values():
            await engine.start()
            await engine.check_health()

    asyncio.run(start_all())
    return made


async def _collect(engine: StageEngine, request: StageRequest, handoff: HandoffPayload | None = None) -> list:
    return [out async for out in engine.stream(request, handoff)]


def run(engine: StageEngine, request: StageRequest, handoff: HandoffPayload | None = None) -> list[StageOutput]:
    return asyncio.run(_collect(engine, request, handoff))


def thinker_request(rid: str = "r", messages: list[ChatMessage] = HELLO, **sampling: Any) -> StageRequest:
    return StageRequest(request_id=rid, sampling=SamplingParams(**sampling), messages=messages)


def text_of(outs: list[StageOutput]) -> str:
    return "".join(o.text for o in outs)


def ids_of(outs: list[StageOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def assert_usage_so_far(outs: list[StageOutput]) -> None:
    """Every output counts the prompt and the tokens generated up to and including its own."""
    assert [o.usage.completion_tokens for o in outs] == [len(ids_of(outs[: i + 1])) for i in range(len(outs))]
    assert len({o.usage.prompt_tokens for o in outs}) == 1


@pytest.fixture(scope="module")
def greedy_handoff(engines: dict[str, StageEngine]) -> HandoffPayload:
    return run(engines["thinker"], thinker_request(temperature=0, max_tokens=8))[-1].handoff


def talk(engines: dict[str, StageEngine], handoff: HandoffPayload, voice: str | None = None, **sampling: Any) -> list:
    return run(engines["talker"], StageRequest("r", SamplingParams(**sampling), handoff=handoff, voice=voice), handoff)


TALK = {"temperature": 0.9, "top_k": 50}


@pytest.fixture(scope="module")
def long_seed(engines: dict[str, StageEngine], greedy_handoff: HandoffPayload) -> int:
    """A seed whose talker sampling runs 14 frames without codec EOS (searched, so no checkpoint id is assumed)."""
    for seed in range(50):
        if talk(engines, greedy_handoff, max_tokens=14, seed=seed, **TALK)[-1].finish_reason is FinishReason.LENGTH:
            return seed
    pytest.fail("no seed in 0..49 keeps the tiny talker talking for 14 frames")


def codes_of(chunks: list[HandoffPayload]) -> np.ndarray:
    return np.concatenate([c.tensors["codes"][:, c.meta["left_context"] :] for c in chunks], axis=1)


def speak(engines: dict[str, StageEngine], chunks: list[HandoffPayload]) -> np.ndarray:
    waves = []
    for i, chunk in enumerate(chunks):
        (out,) = run(engines["code2wav"], StageRequest("r", SamplingParams(), handoff=chunk, chunk_index=i), chunk)
        assert out.finished and out.sample_rate == q.SAMPLE_RATE and out.audio.dtype == np.float32
        waves.append(out.audio)
    return np.concatenate(waves)


# --- args ----------------------------------------------------------------------------------


def test_engine_args() -> None:
    args = te.TransformersEngineArgs(model_stage="talker")
    assert (args.model, args.dtype, args.num_threads) == ("tiny", "float32", 1)
    assert (args.codec_first_chunk_frames, args.codec_chunk_frames, args.codec_left_context_frames) == (25, 25, 25)
    with pytest.raises(pydantic.ValidationError, match="unknown_field"):
        te.create("thinker", {"model_stage": "thinker", "unknown_field": 1})
    with pytest.raises(pydantic.ValidationError, match="model_stage"):
        te.create("x", {"model_stage": "vocoder"})
    from omni_serve.engines.transformers.talker import TalkerEngine

    assert isinstance(te.create("t", {"model_stage": "talker"}), TalkerEngine)


def test_import_is_cheap() -> None:
    code = "import sys, omni_serve.engines.transformers; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unstarted_engine_is_unhealthy() -> None:
    engine = te.create("thinker", {"model_stage": "thinker"})
    with pytest.raises(Exception, match="not started"):
        asyncio.run(engine.check_health())


# --- thinker -------------------------------------------------------------------------------


def test_thinker_streams_text_then_handoff(engines: dict[str, StageEngine]) -> None:
    thinker = engines["thinker"]
    before = thinker.stats()["requests_total"]
    outs = run(thinker, thinker_request(temperature=0, max_tokens=10))
    assert len(outs) >= 2 and all(not o.finished for o in outs[:-1])
    final = outs[-1]
    assert final.finished and final.finish_reason is FinishReason.LENGTH
    assert final.usage.completion_tokens == len(ids_of(outs)) == 10
    assert_usage_so_far(outs)
    assert text_of(outs) == thinker.tokenizer.decode(ids_of(outs), skip_special_tokens=True)
    payload = final.handoff
    assert payload.kind == q.THINKER2TALKER
    assert payload.meta["prompt_len"] == final.usage.prompt_tokens
    assert payload.tensors["token_ids"][final.usage.prompt_tokens :].tolist() == ids_of(outs)
    stats = thinker.stats()
    assert {k: stats[k] for k in ("running", "waiting", "requests_total", "stream_calls", "aborted")} == {
        "running": 0,
        "waiting": 0,
        "requests_total": before + 1,
        "stream_calls": 0,
        "aborted": 0,
    }


def test_thinker_coalesces_tokens_for_a_slow_consumer(engines: dict[str, StageEngine]) -> None:
    thinker = engines["thinker"]

    async def slow() -> list[StageOutput]:
        emitted = thinker.stats()["emitted"]
        stream = thinker.stream(thinker_request(temperature=0, max_tokens=30), None)
        outs = [await anext(stream)]
        # A consumer busy elsewhere until the job is done or held back, MAX_UNTAKEN_OUTPUTS ahead of it.
        while (  # noqa: ASYNC110
            thinker.stats()["running"] and thinker.stats()["emitted"] - emitted < MAX_UNTAKEN_OUTPUTS
        ):
            await asyncio.sleep(0.01)
        return outs + [out async for out in stream]

    outs = asyncio.run(slow())
    assert len(ids_of(outs)) == 30
    assert len(outs) < 30 and max(len(o.token_ids) for o in outs) > 1
    assert_usage_so_far(outs)  # a batch of deltas carries the count after its last one


def test_thinker_text_only_request_has_no_handoff(engines: dict[str, StageEngine]) -> None:
    request = thinker_request(temperature=0, max_tokens=4)
    request.wants_handoff = False
    outs = run(engines["thinker"], request)
    assert outs[-1].finished and outs[-1].handoff is None
    assert ids_of(outs) == ids_of(run(engines["thinker"], thinker_request(temperature=0, max_tokens=4)))


def test_thinker_same_seed_same_tokens(engines: dict[str, StageEngine]) -> None:
    thinker = engines["thinker"]
    a = ids_of(run(thinker, thinker_request(temperature=1.0, max_tokens=12, seed=1)))
    b = ids_of(run(thinker, thinker_request(temperature=1.0, max_tokens=12, seed=1)))
    c = ids_of(run(thinker, thinker_request(temperature=1.0, max_tokens=12, seed=2)))
    assert a == b
    assert a != c


def test_top_k_1_decodes_greedily_without_sampling(engines: dict[str, StageEngine]) -> None:
    # top_k 1 leaves one candidate whatever the temperature / top_p / seed: the greedy tokens (with the
    # repetition penalty still applied), and HF's sampling path (a sort and a draw over the vocabulary)
    # is not run for it.
    assert sampling.sampling_kwargs(SamplingParams(temperature=0.9, top_k=1, top_p=0.5))["do_sample"] is False
    assert sampling.sampling_kwargs(SamplingParams(temperature=0.9, top_k=2))["do_sample"] is True
    thinker = engines["thinker"]
    greedy = ids_of(run(thinker, thinker_request(temperature=0, repetition_penalty=1.3, max_tokens=12)))
    for seed in (1, 2):
        top1 = thinker_request(temperature=0.9, top_k=1, top_p=0.5, repetition_penalty=1.3, max_tokens=12, seed=seed)
        assert ids_of(run(thinker, top1)) == greedy


def test_generate_skips_hf_per_call_config_scan_and_full_prompt_logits(
    engines: dict[str, StageEngine], greedy_handoff: HandoffPayload, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two costs HF's generate() pays before the first token that the engines avoid (same tokens:
    # test_chained_engines_reproduce_hf_generate compares with HF's own generate()).
    # 1. Called without a generation_config, generate() scans the model config for generation
    #    settings by building a default instance of the whole config class, every call.
    def scan(config: Any) -> dict[str, Any]:
        raise AssertionError(f"generate() scanned {type(config).__name__}: no generation_config was passed")

    thinker, talker = engines["thinker"], engines["talker"]
    for config in (thinker.thinker.config, talker.talker.config):  # not the code predictor's: HF calls that one
        monkeypatch.setattr(type(config), "_get_generation_parameters", scan)
    assert ids_of(run(thinker, thinker_request(temperature=0, max_tokens=4)))
    assert talk(engines, greedy_handoff, max_tokens=2, seed=0, **TALK)[-1].finished
    monkeypatch.undo()
    # 2. The thinker's forward has no logits_to_keep: its lm_head sees only the last position
    #    (generate() samples from that one), and its logits are the full projection's last row.
    import torch

    prompt = thinker.tokenizer("Hello there, how are you?", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = thinker.thinker(input_ids=prompt, attention_mask=torch.ones_like(prompt), output_hidden_states=True)
        full = torch.nn.functional.linear(out.hidden_states[-1], thinker.thinker.lm_head.weight)
    assert prompt.shape[1] > 1 and out.logits.shape == (1, 1, full.shape[-1])
    torch.testing.assert_close(out.logits[0, -1], full[0, -1])


def test_concurrent_thinker_requests_match_solo_runs(engines: dict[str, StageEngine]) -> None:
    thinker = engines["thinker"]
    solo = [ids_of(run(thinker, thinker_request(f"s{s}", temperature=1.0, max_tokens=12, seed=s))) for s in (3, 4)]

    async def together() -> list[list[StageOutput]]:
        return await asyncio.gather(
            *(_collect(thinker, thinker_request(f"c{s}", temperature=1.0, max_tokens=12, seed=s)) for s in (3, 4))
        )

    assert [ids_of(outs) for outs in asyncio.run(together())] == solo


def test_thinker_stop_string(engines: dict[str, StageEngine]) -> None:
    thinker = engines["thinker"]
    full = run(thinker, thinker_request(temperature=0, max_tokens=20))
    text, ids = text_of(full), ids_of(full)
    # A stop string that starts at a token boundary (a word of the tiny vocab not seen before it).
    decode = thinker.tokenizer.decode
    k = next(k for k in range(1, len(ids)) if decode(ids[k : k + 1]).strip() not in decode(ids[:k]))
    stop = decode(ids[k : k + 1]).strip()
    assert text.index(stop) == len(decode(ids[:k])) + 1
    outs = run(thinker, thinker_request(temperature=0, max_tokens=20, stop=[stop]))
    assert text_of(outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].usage.completion_tokens < 20
    # The talker is handed only the tokens before the stop string.
    payload = outs[-1].handoff
    spoken = payload.tensors["token_ids"][payload.meta["prompt_len"] :].tolist()
    assert decode(spoken, skip_special_tokens=True) == decode(ids[:k]) == text[: text.index(stop)].removesuffix(" ")


def test_thinker_stop_token_ids(engines: dict[str, StageEngine]) -> None:
    thinker = engines["thinker"]
    full = ids_of(run(thinker, thinker_request(temperature=0, max_tokens=12)))
    outs = run(thinker, thinker_request(temperature=0, max_tokens=12, stop_token_ids=[full[3]]))
    assert ids_of(outs) == full[: full.index(full[3]) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP


def test_thinker_prompt_longer_than_context(engines: dict[str, StageEngine]) -> None:
    long = [ChatMessage(role="user", content="x" * 2000)]
    with pytest.raises(InvalidStageInput, match="context is 1024 tokens"):
        run(engines["thinker"], thinker_request(messages=long))


@pytest.fixture(scope="module")
def slow_thinker() -> StageEngine:
    """A thinker that takes 2 s per token (the engine's step pacing): 800 tokens would take half an
    hour, so a request that ends early can only have been stopped."""
    engine = te.create("slow-thinker", {"model_stage": "thinker", "min_step_s": 2.0})
    asyncio.run(engine.start())
    return engine


def test_thinker_abort(slow_thinker: StageEngine) -> None:
    async def go() -> list[StageOutput]:
        outs = []
        async for out in slow_thinker.stream(thinker_request("abort-me", temperature=1.0, max_tokens=800), None):
            if not outs:
                await slow_thinker.abort("abort-me")
            outs.append(out)
        return outs

    outs = asyncio.run(go())
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT
    assert outs[-1].usage.completion_tokens < 800


def test_cancelled_consumer_stops_generation(slow_thinker: StageEngine) -> None:
    async def go() -> None:
        stream = slow_thinker.generate(thinker_request("gone", temperature=1.0, max_tokens=800, seed=0), None)
        await anext(stream)
        await stream.aclose()  # what a cancelled stage call does to the engine's stream
        # Watched with the loop still running: once it closes, the job's next emit fails and stops it anyway.
        deadline = time.monotonic() + 30  # aborted, the job stops within a step (2 s); unstopped it runs for hours
        while slow_thinker.stats()["running"]:
            assert time.monotonic() < deadline, "the engine kept generating for a consumer that left"
            await asyncio.sleep(0.01)

    asyncio.run(go())
    # The worker is free again: the next request runs at once.
    assert run(slow_thinker, thinker_request(temperature=0, max_tokens=1))[-1].finished


# --- talker and code2wav -------------------------------------------------------------------


def test_talker_streams_chunks_code2wav_decodes(
    engines: dict[str, StageEngine], greedy_handoff: HandoffPayload, long_seed: int
) -> None:
    outs = talk(engines, greedy_handoff, max_tokens=14, seed=long_seed, **TALK)
    chunks = [o.handoff for o in outs if o.handoff is not None]
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    frames = final.usage.completion_tokens
    assert final.finish_reason is FinishReason.LENGTH and frames == 14
    assert frames == sum(c.meta["num_frames"] for c in chunks)
    assert [c.meta["num_frames"] for c in chunks] == [FIRST, CHUNK, 14 - FIRST - CHUNK]
    assert [c.meta["index"] for c in chunks] == list(range(len(chunks)))
    assert all(c.tensors["codes"].shape[0] == 16 for c in chunks)
    audio = speak(engines, chunks)
    assert audio.shape == (frames * 1920 - hf_lag(engines["code2wav"].code2wav),)
    assert 0 < np.abs(audio).max() <= 1


def test_talker_and_code2wav_are_deterministic_per_seed(engines: dict[str, StageEngine], greedy_handoff):
    def codes(seed: int) -> np.ndarray:
        outs = talk(engines, greedy_handoff, temperature=0.9, top_k=50, max_tokens=8, seed=seed)
        return codes_of([o.handoff for o in outs if o.handoff is not None])

    a, b, c = codes(5), codes(5), codes(6)
    np.testing.assert_array_equal(a, b)
    assert a.shape != c.shape or not np.array_equal(a, c)
    chunks = codec.chunk_codec_codes(a, FIRST, CHUNK, 25)
    np.testing.assert_array_equal(speak(engines, chunks), speak(engines, chunks))


def test_only_the_talker_has_voices_and_each_one_speaks(engines: dict[str, StageEngine], greedy_handoff) -> None:
    assert engines["thinker"].voices() == engines["code2wav"].voices() == []
    voices = engines["talker"].voices()
    assert voices and voices == sorted(v.lower() for v in voices)
    for voice in voices:
        assert talk(engines, greedy_handoff, voice=voice, temperature=0, max_tokens=1)[-1].finished


def test_talker_rejects_unknown_voice(engines: dict[str, StageEngine], greedy_handoff: HandoffPayload) -> None:
    with pytest.raises(InvalidStageInput, match=r"'nobody'.*\['aiden', 'chelsie', 'ethan'\]"):
        talk(engines, greedy_handoff, voice="nobody")
    outs = talk(engines, greedy_handoff, voice="Chelsie", temperature=0, max_tokens=2, seed=0)
    assert outs[-1].finished


def test_stages_reject_wrong_handoffs(engines: dict[str, StageEngine], greedy_handoff: HandoffPayload) -> None:
    with pytest.raises(InvalidStageInput, match="thinker2talker"):
        talk(engines, None)
    with pytest.raises(InvalidStageInput, match="codec_chunk"):
        run(engines["code2wav"], StageRequest("r", SamplingParams(), handoff=greedy_handoff), greedy_handoff)


def test_talker_abort(greedy_handoff: HandoffPayload, long_seed: int) -> None:
    """A talker taking 1 s per frame (the engine's step pacing) is aborted after its first chunk (1 frame); with this
    seed codec EOS cannot come before frame 14, so only the abort can end it."""
    talker = te.create("slow-talker", {"model_stage": "talker", "codec_first_chunk_frames": 1, "min_step_s": 1.0})

    async def go() -> list[StageOutput]:
        await talker.start()
        outs = []
        request = StageRequest("talk-abort", SamplingParams(max_tokens=500, seed=long_seed, **TALK))
        async for out in talker.stream(request, greedy_handoff):
            if not outs:
                await talker.abort("talk-abort")
            outs.append(out)
        return outs

    outs = asyncio.run(go())
    assert outs[-1].finish_reason is FinishReason.ABORT
    assert outs[-1].usage.completion_tokens < 14


# --- the reference: our chained stages reproduce transformers' own generate() --------------


def test_chained_engines_reproduce_hf_generate(engines: dict[str, StageEngine]) -> None:
    """Thinker (greedy) -> handoff -> talker (greedy first group, seeded residual groups) -> code2wav.

    HF's code predictor always samples the 15 residual code groups, so both sides seed torch with
    the same seed right before the talker's draws (HF's greedy thinker draws nothing in between).
    """
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi! ¿Qué tal?")]
    max_tokens, max_frames, seed = 10, 16, 11

    thinker_outs = run(engines["thinker"], thinker_request(messages=messages, temperature=0, max_tokens=max_tokens))
    talker_outs = talk(engines, thinker_outs[-1].handoff, temperature=0, max_tokens=max_frames, seed=seed)
    chunks = [o.handoff for o in talker_outs if o.handoff is not None]
    ours = speak(engines, chunks)

    ref_text, ref_wav = hf_reference_generate(
        engines["thinker"].model_path, messages, max_new_tokens=max_tokens, max_frames=max_frames, seed=seed
    )
    assert text_of(thinker_outs) == ref_text
    assert len(chunks) > 1 and ours.shape == ref_wav.shape
    # Same codes: one decode of all our frames is HF's waveform exactly (HF decodes <= 300 frames at once).
    single = q.decode_codec_chunk(engines["code2wav"].code2wav, codec.chunk_codec_codes(codes_of(chunks), 10**6)[0])
    np.testing.assert_array_equal(single, ref_wav)
    # Streamed chunks (4, then 5, with 25 frames of context) stay within the measured chunking tolerance.
    err = ours - ref_wav
    assert np.abs(err).max() < 0.03
    assert np.sqrt(np.mean(err**2) / np.mean(ref_wav**2)) < 0.03


def test_vllm_sampling_parameters_the_family_honours() -> None:
    assert te.honoured_sampling({"model_stage": "thinker"}) == {
        "ignore_eos",
        "min_p",
        "skip_special_tokens",
        "logit_bias",
        "logprobs",
        "structured_outputs",  # xgrammar is installed here (with vLLM)
    }
    assert te.honoured_sampling({"model_stage": "talker"}) == {
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    }
    assert "ignore_eos" not in te.honoured_sampling({"model_stage": "code2wav"})
    # ignore_eos drops the model's EOS tokens from what ends a generation; stop token ids still end it.
    assert te.end_ids([7, 9], {3}, ignore_eos=False) == [3, 7, 9]
    assert te.end_ids([7, 9], {3}, ignore_eos=True) == [3]
    assert te.end_ids([7, 9], set(), ignore_eos=True) == []


def test_thinker_ignore_eos_runs_to_max_tokens(
    engines: dict[str, StageEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny random thinker almost never samples its EOS, so its 5th greedy token is declared the EOS here."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    tokens = [
        t
        for o in run(engines["thinker"], StageRequest("e0", greedy, messages=HELLO, wants_handoff=False))
        for t in o.token_ids
    ]
    eos = tokens[4]
    assert eos not in tokens[:4], "the tiny thinker's greedy reply repeats a token early; pick another position"
    monkeypatch.setattr(engines["thinker"], "eos_ids", [eos])
    ended = run(engines["thinker"], StageRequest("e1", greedy, messages=HELLO, wants_handoff=False))
    assert ended[-1].finish_reason is FinishReason.STOP and ended[-1].usage.completion_tokens == 5
    ignoring = greedy.model_copy(update={"ignore_eos": True})
    outputs = run(engines["thinker"], StageRequest("e2", ignoring, messages=HELLO, wants_handoff=False))
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].usage.completion_tokens == 8


def test_talker_ignore_eos_runs_to_max_tokens(engines: dict[str, StageEngine], greedy_handoff: HandoffPayload) -> None:
    """A seed whose talker samples its codec EOS early (searched) runs to max_tokens frames with ignore_eos."""
    seed = next(
        (
            s
            for s in range(50)
            if talk(engines, greedy_handoff, max_tokens=14, seed=s, **TALK)[-1].finish_reason is FinishReason.STOP
        ),
        None,
    )
    assert seed is not None, "no seed in 0..49 makes the tiny talker stop before 14 frames"
    assert talk(engines, greedy_handoff, max_tokens=14, seed=seed, **TALK)[-1].usage.completion_tokens < 14
    ignoring = talk(engines, greedy_handoff, max_tokens=14, seed=seed, ignore_eos=True, **TALK)[-1]
    assert ignoring.finish_reason is FinishReason.LENGTH and ignoring.usage.completion_tokens == 14


def test_talker_sizes_its_step_rows_by_its_context_not_by_max_tokens(
    engines: dict[str, StageEngine], greedy_handoff: HandoffPayload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The talker allocates one row per step it may take up front: a request's max_tokens (up to the API's
    bound, 2**20) must not size it, the talker's context does (it could not take more steps anyway)."""
    steps: list[int] = []
    real = q.TrailingText.__init__

    def recording(self: q.TrailingText, inputs: Any, n: int) -> None:
        steps.append(n)
        real(self, inputs, n)

    monkeypatch.setattr(q.TrailingText, "__init__", recording)

    def stops_early(seed: int) -> bool:
        return talk(engines, greedy_handoff, max_tokens=14, seed=seed, **TALK)[-1].usage.completion_tokens < 14

    seed = next(s for s in range(50) if stops_early(s))
    steps.clear()
    final = talk(engines, greedy_handoff, max_tokens=MAX_TOKENS_LIMIT, seed=seed, **TALK)[-1]
    context = engines["talker"].config.talker_config.text_config.max_position_embeddings  # type: ignore[attr-defined]
    assert final.finish_reason is FinishReason.STOP and steps and steps[0] <= context + 1, (steps, context)


# --- logprobs, structured outputs and tool calls (the thinker) ------------------------------------------


def test_thinker_logprobs_are_the_models_own_log_softmax(engines: dict[str, StageEngine]) -> None:
    """Each token's logprob is the log-softmax of the model's raw logits at its step (vLLM's raw_logprobs),
    checked against HF's own generate(output_logits=True); a logit_bias changes the pick, not the reported
    logprob (raw: before any processor, as in vLLM)."""
    import torch

    thinker = engines["thinker"]
    outs = run(thinker, thinker_request(temperature=0, max_tokens=6, logprobs=3))
    entries = [e for o in outs for e in o.logprobs or []]
    ids = ids_of(outs)
    assert len(entries) == len(ids) == 6
    prompt = thinker.tokenizer.apply_chat_template(
        [{"role": "user", "content": HELLO[0].content}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.inference_mode():
        ref = thinker.thinker.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=thinker.eos_ids,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert ref.sequences[0, prompt.shape[1] :].tolist() == ids
    for entry, token, logits in zip(entries, ids, ref.logits, strict=True):
        expected = torch.log_softmax(logits[0].float(), -1)
        assert entry.token == thinker.tokenizer.decode([token])
        assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-5)
        assert [t for t, _ in entry.top][0] == entry.token  # greedy: the top token is the one sampled
        assert [lp for _, lp in entry.top] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)
    forced = run(thinker, thinker_request(temperature=0, max_tokens=1, logprobs=0, logit_bias={ids[0] + 1: 100.0}))
    (entry,) = forced[-1].logprobs or forced[0].logprobs
    assert ids_of(forced) == [ids[0] + 1] and entry.logprob < entries[0].logprob and entry.top == []


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
    },
}
# The random tiny thinker would pad JSON with whitespace forever (its tab logit is 0, above many others):
# tests that leave whitespace free bias it away, as a client may.
NO_WHITESPACE = {9: -100.0, 10: -100.0, 13: -100.0, 32: -100.0}
SURE = "Sure. "
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_thinker() -> StageEngine:
    thinker = te.create("thinker", {"model_stage": "thinker", "tool_call_parser": "hermes"})
    asyncio.run(thinker.start())
    return thinker


def regex(text: str) -> dict[str, Any]:
    """A regular expression matching exactly ``text`` (xgrammar's dialect: only its metacharacters escaped)."""
    import re

    return {"regex": re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)}


def tool_request(rid: str, choice: dict[str, Any], stream_handoff: bool = True, **sampling: Any) -> StageRequest:
    return StageRequest(
        rid,
        SamplingParams(**{"temperature": 0, "max_tokens": 120, **sampling}),
        messages=[ChatMessage(role="user", content="The weather?")],
        tools=ToolCalling(tools=[WEATHER], **choice),
        stream_handoff=stream_handoff,
    )


def reply_rows(outs: list[StageOutput]) -> np.ndarray:
    """The reply's rows the thinker handed on (streamed chunks, or the whole payload's past the prompt)."""
    chunks = [o.handoff for o in outs if o.handoff is not None]
    if chunks[0].meta.get("streamed"):
        rows = [chunks[0].tensors["embeds"][chunks[0].meta["prompt_len"] :]]
        return np.concatenate(rows + [c.tensors["embeds"] for c in chunks[1:]])
    return chunks[0].tensors["embeds"][chunks[0].meta["prompt_len"] :]


def test_response_format_constrains_the_thinker(tool_thinker: StageEngine) -> None:
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    request = thinker_request(
        temperature=0, max_tokens=60, logit_bias=NO_WHITESPACE, structured_outputs={"json": schema}
    )
    outs = run(tool_thinker, request)
    assert outs[-1].finish_reason is FinishReason.STOP  # the grammar ended it, on the model's EOS
    assert isinstance(json.loads(text_of(outs))["ok"], bool)


def test_a_reply_with_text_and_a_call_hands_the_talker_only_the_text(tool_thinker: StageEngine) -> None:
    """Forced to write text then a call (a regex), the thinker's client text and handoff are those of the text
    alone: the same rows, bit for bit, streamed or whole, as a reply forced to be just that text."""
    for streamed in (True, False):
        both = run(tool_thinker, tool_request(f"b{streamed}", {}, streamed, structured_outputs=regex(SURE + CALL)))
        text = run(tool_thinker, tool_request(f"t{streamed}", {}, streamed, structured_outputs=regex(SURE)))
        assert text_of(both) == text_of(text) == SURE
        calls = [c for o in both for c in o.tool_calls]
        assert calls[0].name == "get_weather" and "".join(c.arguments for c in calls) == '{"unit": "c"}'
        assert both[-1].finish_reason is FinishReason.TOOL_CALLS and text[-1].finish_reason is FinishReason.STOP
        assert len(ids_of(both)) > len(ids_of(text))  # the call's tokens were generated...
        np.testing.assert_array_equal(reply_rows(both), reply_rows(text))  # ...and never handed on
        assert len(reply_rows(text)) == len(SURE)  # one row per spoken token (byte tokens)


def test_a_forced_call_speaks_nothing(tool_thinker: StageEngine) -> None:
    import json

    for choice in ({"choice": "required", "parallel": False}, {"function": "get_weather"}):
        outs = run(tool_thinker, tool_request("f", choice, logit_bias=NO_WHITESPACE))
        assert text_of(outs) == ""
        (call,) = [c for o in outs for c in o.tool_calls if c.name]
        arguments = "".join(c.arguments for o in outs for c in o.tool_calls)
        assert call.name == "get_weather" and json.loads(arguments)["unit"] in ("c", "f")
        assert len(reply_rows(outs)) == 0
        reason = FinishReason.STOP if "function" in choice else FinishReason.TOOL_CALLS
        assert outs[-1].finish_reason is reason


def test_tools_need_a_parser(engines: dict[str, StageEngine]) -> None:
    with pytest.raises(InvalidStageInput, match="tool_call_parser") as refused:
        run(engines["thinker"], tool_request("n", {}))
    assert refused.value.param == "tools"
    # tool_choice none: the tools reach the prompt, nothing is parsed, no parser needed
    outs = run(engines["thinker"], tool_request("n", {"choice": "none"}, max_tokens=3))
    assert outs[-1].usage.prompt_tokens > 300  # the tools are in the prompt
