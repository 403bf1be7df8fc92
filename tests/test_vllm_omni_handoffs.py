"""vLLM-Omni's real stage input processors accept what our vllm_omni stages forward (CPU).

Synthetic tensors of the real shapes (Qwen3-Omni: thinker hidden 2048, accept layer 24,
16 code groups; Qwen2.5-Omni: thinker hidden 3584), each handoff pickled and unpickled
as the object store does between replicas.
"""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.deps import require

pytestmark = pytest.mark.vllm_cpu
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.engines.vllm_omni import mapping as engine  # noqa: E402
from omni_serve.exceptions import EngineError  # noqa: E402
from omni_serve.models.vllm_omni import edges, pipelines, qwen_omni  # noqa: E402
from omni_serve.models.vllm_omni.payload import from_handoff, merge_steps, split_steps  # noqa: E402
from omni_serve.payload import HandoffPayload  # noqa: E402
from omni_serve.types import SamplingParams  # noqa: E402

IM_START, SYSTEM, USER, ASSISTANT = 151644, 8948, 872, 77091
HIDDEN, ACCEPT_LAYER, GROUPS = 2048, 24, 16
QWEN3_CONFIG = SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=ACCEPT_LAYER))


def producer(pipeline: str, stage_id: int, hf_config: Any = QWEN3_CONFIG, **chunk_config: Any) -> edges.Producer:
    """A stage's producer side as its engine builds it: the declared stage and the pipeline's hooks."""
    stage = pipelines.stage(pipeline, stage_id)
    hooks = pipelines.hooks(pipeline).stage(stage.model_stage)
    return edges.Producer(stage, hf_config, hooks, chunk_config or None)


def consumer(pipeline: str, stage_id: int, handoff: HandoffPayload, voice: str | None = None) -> dict:
    """A stage's prompt from its upstream's handoff, as its engine builds it."""
    stage = pipelines.stage(pipeline, stage_id)
    upstream = [pipelines.stage(pipeline, i) for i in stage.input_sources]
    generation = pipelines.kind(stage) == "generation"
    return edges.consumer_prompt(
        stage, [handoff], upstream=upstream, request_id="r", voice=voice, generation=generation
    )


def through_object_store(payload: HandoffPayload) -> HandoffPayload:
    restored = pickle.loads(pickle.dumps(payload))
    for array in restored.tensors.values():
        array.setflags(write=False)  # what ray.get hands out on one node
    return restored


def chat_prompt(user_len: int) -> list[int]:
    system = [IM_START, SYSTEM, 198, 1, 2, 151645, 198]
    user = [IM_START, USER, 198, *range(1000, 1000 + user_len - 5), 151645, 198]
    return [*system, *user, IM_START, ASSISTANT, 198]


def thinker_output(prompt: list[int], output: list[int]) -> dict:
    """What the thinker engine accumulates: captured layers 0 and accept layer, tts embeds."""
    rows = len(prompt) + len(output)
    gen = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return {
        "hidden_states": {"layers": {0: t(rows, HIDDEN), ACCEPT_LAYER: t(rows, HIDDEN)}},
        "embed": {"tts_bos": [t(1, 1, HIDDEN)], "tts_eos": [t(1, 1, HIDDEN)], "tts_pad": [t(1, 1, HIDDEN)]},
    }


def qwen3_thinker_handoff(prompt: list[int], output: list[int], mm: dict) -> HandoffPayload | None:
    return producer("qwen3_omni_moe", 0).whole("r1", prompt, output, mm)


def test_qwen3_thinker_to_talker_through_real_processors():
    prompt, output = chat_prompt(user_len=12), [3, 4, 5, 6, 151645]
    mm = thinker_output(prompt, output)
    payload = qwen3_thinker_handoff(prompt, output, mm)
    assert payload is not None and payload.kind == "vllm_omni.qwen3_omni.thinker2talker_full_payload"
    assert all(isinstance(a, np.ndarray) for a in payload.tensors.values())
    assert payload.tensors["embed.prefill"].dtype == np.int16  # bf16 words, not widened
    assert payload.tensors["embed.prefill"].shape == (len(prompt) + len(output) - 1, HIDDEN)

    talker = consumer("qwen3_omni_moe", 1, through_object_store(payload), voice="Ethan")
    # thinker2talker_token_only: user turn (im_start..next im_start) + 9 assistant slots, as placeholders.
    assert talker["prompt_token_ids"] == [0] * (12 + 9)
    info = talker["additional_information"]
    assert torch.equal(info["embed"]["prefill"], mm["hidden_states"]["layers"][0][:-1])
    assert torch.equal(info["hidden_states"]["output"], mm["hidden_states"]["layers"][ACCEPT_LAYER][:-1])
    assert torch.equal(info["embed"]["tts_pad"], mm["embed"]["tts_pad"][0])
    assert info["ids"] == {"all": prompt + output, "prompt": prompt}
    assert info["speaker"] == "Ethan"

    # The engine request the talker replica builds carries the payload to the worker intact.
    from vllm import SamplingParams as VllmSamplingParams
    from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens
    from vllm_omni.engine.serialization import deserialize_additional_information

    request = build_engine_core_request_from_tokens("r1-talker-0", talker, VllmSamplingParams(max_tokens=8))
    worker_view = deserialize_additional_information(request.additional_information)
    assert torch.equal(worker_view["hidden_states"]["output"], info["hidden_states"]["output"])
    assert worker_view["embed"]["prefill"].dtype == torch.bfloat16


def _engine_outputs(mm: dict, prompt_len: int, replies: int) -> list[dict]:
    """The thinker's accumulated multimodal output after each engine step, as the real engine hands them
    out (synchronous scheduling: the prefill's block, then a growing list of one-row parts, then one
    consolidated tensor at the finish; the last sampled token's row is never computed)."""
    layers = mm["hidden_states"]["layers"]

    def parts(n: int) -> dict:
        steps = range(prompt_len, prompt_len + n)
        return {k: [v[:prompt_len], *(v[i : i + 1] for i in steps)] for k, v in layers.items()}

    outputs = [{"hidden_states": {"layers": {k: v[:prompt_len] for k, v in layers.items()}}, "embed": mm["embed"]}]
    outputs += [{"hidden_states": {"layers": parts(n)}, "embed": mm["embed"]} for n in range(1, replies - 1)]
    final = {k: v[: prompt_len + replies - 1] for k, v in layers.items()}
    return [*outputs, {"hidden_states": {"layers": final}, "embed": {k: v[0] for k, v in mm["embed"].items()}}]


def _streamed(prompt: list[int], output: list[int], outputs: list[dict], read: list[int]) -> list[HandoffPayload]:
    """The chunks the thinker's declared async-chunk processor cuts when the stage reads the outputs at the steps
    in ``read`` (a stage that reads late sees several steps in one output), each run through the object store."""
    transfer = producer("qwen3_omni_moe", 0).chunks("r1", prompt)
    steps = []
    for i in read:
        run = edges.run_of(transfer.push(outputs[i], output[: i + 1], finished=i == len(outputs) - 1))
        if run is not None:
            steps += split_steps(through_object_store(run))
    return steps


def test_qwen3_thinker_chunks_are_vllm_omnis_async_chunks():
    """The streamed thinker -> talker handoff: vLLM-Omni's thinker2talker_async_chunk run per engine step,
    whatever steps the stage's reads merged: chunk 0 holds the prompt's rows and the first reply row
    (with the ids and tts embeds), then one reply row a chunk, the last one marked finished."""
    prompt, output = chat_prompt(user_len=12), [3, 4, 5, 6, 151645]
    mm = thinker_output(prompt, output)
    outputs = _engine_outputs(mm, len(prompt), len(output))
    every_step = _streamed(prompt, output, outputs, read=list(range(len(outputs))))
    late = _streamed(prompt, output, outputs, read=[0, 2, len(outputs) - 1])  # steps 1 and 3 read with 2 and 4

    layer0, accept = mm["hidden_states"]["layers"][0], mm["hidden_states"]["layers"][ACCEPT_LAYER]
    first = from_handoff(every_step[0])
    assert torch.equal(first["embed"]["prefill"], layer0[: len(prompt) + 1])
    assert torch.equal(first["hidden_states"]["output"], accept[: len(prompt) + 1])
    assert first["ids"]["prompt"] == prompt and torch.equal(first["embed"]["tts_pad"], mm["embed"]["tts_pad"][0])
    decoded = [from_handoff(step) for step in every_step[1:]]
    # The reply's rows after the first, one a chunk, up to the last computed one (the stop token has none).
    assert torch.equal(torch.cat([d["embed"]["decode"] for d in decoded]), layer0[len(prompt) + 1 : -1])
    assert [bool(d["meta"]["finished"]) for d in decoded] == [False] * (len(decoded) - 1) + [True]

    assert len(late) == len(every_step)
    for a, b in zip(every_step, late, strict=True):
        assert a.tensors.keys() == b.tensors.keys()
        assert all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)

    # The stage may coalesce two runs (merge_handoffs): one run of the same chunks, in order.
    transfer = producer("qwen3_omni_moe", 0).chunks("r2", prompt)
    runs = [edges.run_of(transfer.push(o, output[: i + 1], i == len(outputs) - 1)) for i, o in enumerate(outputs)]
    merged = runs[1]
    for run in runs[2:]:
        merged = merge_steps(merged, run)
    assert [s.tensors.keys() for s in split_steps(merged)] == [s.tensors.keys() for s in every_step]

    # The talker's placeholder prompt: as vLLM-Omni's async-chunk prewarm sizes it (user turn + 9).
    assert qwen_omni.talker_chunk_prompt(every_step[0]) == {"prompt_token_ids": [0] * (12 + 9)}


def test_qwen3_talker_to_code2wav_full_payload():
    frames = 30
    codes = torch.randint(0, 2048, (frames, GROUPS))
    output_ids = codes[:, 0].tolist()
    payload = producer("qwen3_omni_moe", 1).whole("r1", [0] * 9, output_ids, {}, rows={"codes.audio": codes})
    assert payload is not None and payload.kind == "vllm_omni.qwen3_omni.talker2code2wav_full_payload"
    prompt = consumer("qwen3_omni_moe", 2, through_object_store(payload))
    # codebook-major, as Code2Wav reshapes input_ids to [1, 16, frames]
    assert prompt["prompt_token_ids"] == codes.transpose(0, 1).reshape(-1).tolist()
    assert "additional_information" not in prompt  # whole utterance: no left context


def test_qwen3_codec_chunks_carry_left_context_and_cover_every_frame_once():
    frames = 83
    codes = torch.randint(0, 2048, (frames, GROUPS))
    connector = {"codec_chunk_frames": 25, "codec_left_context_frames": 25, "initial_codec_chunk_frames": 4}
    chunker = producer("qwen3_omni_moe", 1, **connector).chunks("r1", (), stop_token_ids=[2150])
    # The talker's accumulated codes after each engine step: a growing list of one-frame tensors.
    steps = [chunker.push({"codes": {"audio": list(codes[: i + 1].split(1))}}, [], False) for i in range(frames)]
    steps.append(chunker.push({"codes": {"audio": codes}}, [], finished=True))  # the finish: nothing new
    chunks = [through_object_store(c) for step in steps for c in step]
    assert [c.meta["chunk"] for c in chunks] == list(range(len(chunks)))

    decoded = []
    for chunk in chunks:
        prompt = consumer("qwen3_omni_moe", 2, chunk)
        ids = torch.tensor(prompt["prompt_token_ids"]).reshape(GROUPS, -1).transpose(0, 1)
        left = prompt["additional_information"]["meta"]["left_context_size"]
        decoded.append(ids[left:])
    sizes = [len(d) for d in decoded]
    assert sizes[0] == 4 and sizes[1:-1] == [25] * (len(sizes) - 2)  # small first chunk cuts time to audio
    assert torch.equal(torch.cat(decoded), codes)


def test_qwen2_5_thinker_to_talker_to_code2wav():
    """The thinker's hidden states as its engine hands them over: under its ``engine_output_type`` (``latent``),
    the key vLLM-Omni's client renames its runner's ``hidden`` to, while thinker2talker_full_payload reads
    ``hidden``."""
    prompt, output = chat_prompt(user_len=9), [7, 8, 9, 151645]
    hidden = torch.randn(len(prompt) + len(output), 3584).to(torch.bfloat16)
    payload = producer("qwen2_5_omni", 0, hf_config=None).whole("r2", prompt, output, {"latent": hidden})
    assert payload is not None and payload.kind == "vllm_omni.qwen2_5_omni.thinker2talker_full_payload"
    talker = consumer("qwen2_5_omni", 1, through_object_store(payload))
    from vllm_omni.model_executor.stage_input_processors import qwen2_5_omni as upstream

    assert talker["prompt_token_ids"] == [
        upstream.TALKER_CODEC_START_TOKEN_ID,
        *[upstream.TALKER_CODEC_PAD_TOKEN_ID] * len(prompt),
        upstream.TALKER_CODEC_END_TOKEN_ID,
    ]
    info = talker["additional_information"]
    assert torch.equal(info["embed"]["prefill"], hidden[: len(prompt)].float())
    assert info["hidden_states"]["output"].shape == (len(output) - 1, 3584)  # stop-token row dropped
    assert info["ids"]["output"] == output[:-1]

    codec = [5, 17, 400, 8000, upstream.TALKER_CODEC_END_TOKEN_ID]
    talker_payload = producer("qwen2_5_omni", 1, hf_config=None).whole("r2", [0] * 11, codec, {})
    prompt2 = consumer("qwen2_5_omni", 2, through_object_store(talker_payload))
    assert prompt2["prompt_token_ids"] == [5, 17, 400, 8000]


def test_wrong_kind_is_rejected():
    payload = HandoffPayload(kind="qwen3_omni.thinker2talker", tensors={}, meta={})
    with pytest.raises(ValueError, match="vllm_omni.qwen3_omni.thinker2talker_full_payload"):
        consumer("qwen3_omni_moe", 1, payload)


def test_engine_output_helpers():
    audio = torch.linspace(-1, 1, 1920 * 3).reshape(1, -1)
    samples, rate = engine.audio_samples({"audio": [audio], "sr": [torch.tensor(24000)]})
    assert samples.dtype == np.float32 and samples.shape == (1920 * 3,) and rate == 24000
    out = SimpleNamespace(multimodal_output=None, outputs=[SimpleNamespace(multimodal_output={"x": 1})])
    assert engine.multimodal_output(out) == {"x": 1}
    assert engine.finish_reason("length").value == "length" and engine.finish_reason(None).value == "stop"


def test_codec_rows_returns_each_frame_once():
    """What the talker's DELTA outputs carry, step by step (seen on the real engine): the prefill's
    all-zero placeholder rows as one tensor, then a growing list that starts with that tensor,
    then everything consolidated when it finishes."""
    prefill = torch.zeros(3, GROUPS, dtype=torch.long)
    frames = torch.arange(1, 5 * GROUPS + 1).reshape(5, GROUPS)
    rows = edges.NewRows(placeholders=True)
    assert rows.new(prefill) is None  # placeholders only
    assert torch.equal(rows.new([prefill, frames[0:1]]), frames[0:1])
    assert rows.new([prefill, frames[0:1]]) is None  # nothing new this step
    assert torch.equal(rows.new([prefill, frames[0:1], frames[1:2], frames[2:3]]), frames[1:3])
    assert torch.equal(rows.new(torch.cat([prefill, frames])), frames[3:5])  # consolidated: only unseen rows
    assert rows.new(torch.cat([prefill, frames])) is None and rows.rows == 8


def test_sampling_params_apply_stage_constraints():
    from vllm.sampling_params import RequestOutputKind

    params = engine.vllm_sampling_params(
        SamplingParams(temperature=0.9, top_k=50, max_tokens=64, stop_token_ids=[7]),
        {"stop_token_ids": [2150], "detokenize": False},
        RequestOutputKind.CUMULATIVE,
    )
    assert params.stop_token_ids == [7, 2150] and params.detokenize is False and params.top_k == 50
    # top_k 0 means "no top-k" here and in vLLM: it must arrive as 0, not as some other value.
    assert engine.vllm_sampling_params(SamplingParams(top_k=0), {}, RequestOutputKind.FINAL_ONLY).top_k == 0
    assert engine.vllm_sampling_params(SamplingParams(top_k=7), {}, RequestOutputKind.FINAL_ONLY).top_k == 7


def test_chat_prompt_ids_are_token_ids_with_transformers_5():
    """Regression: with transformers 5, apply_chat_template(tokenize=True) returns a BatchEncoding, whose
    list() is its keys; the thinker sent those to the engine (TypeError in every request)."""
    from omni_serve.checkpoints.tiny_omni import build_omni_tokenizer

    tokenizer = build_omni_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)) == [
        "input_ids",
        "attention_mask",
    ]
    ids = engine.chat_prompt_ids(tokenizer, messages)
    system, user = [IM_START, SYSTEM, 10, *b"Be brief.", 151645, 10], [IM_START, USER, 10, *b"Hi", 151645, 10]
    assert ids == [*system, *user, IM_START, ASSISTANT, 10]


def test_thinker_payload_keeps_every_computed_row():
    """Synchronous scheduling (CPU) never runs the last sampled token: P + N - 1 rows, all handed on;
    with a row for every token (async scheduling), the processor drops the stop token's row."""
    prompt, output = chat_prompt(user_len=6), [3, 4, 5]
    for rows, kept in (
        (len(prompt) + len(output) - 1, len(prompt) + len(output) - 1),
        (len(prompt) + 3, len(prompt) + 2),
    ):
        mm = thinker_output(prompt, output)
        mm["hidden_states"]["layers"] = {k: v[:rows] for k, v in mm["hidden_states"]["layers"].items()}
        info = from_handoff(qwen3_thinker_handoff(prompt, output, mm))
        assert info["embed"]["prefill"].shape[0] == info["hidden_states"]["output"].shape[0] == kept
        assert torch.equal(info["hidden_states"]["output"], mm["hidden_states"]["layers"][ACCEPT_LAYER][:kept])


def test_a_reply_cut_before_a_tool_call_hands_on_the_rows_of_its_text_only():
    """A reply whose text is followed by a tool call: the whole handoff is that of the text ended as a turn
    (its rows, then <|im_end|>), cut from the accumulated output by position; per-request values stay whole."""
    prompt, output, spoken = chat_prompt(user_len=6), [3, 4, 7, 8, 9, 151645], 2
    mm = thinker_output(prompt, output)
    computed = len(prompt) + len(output) - 1  # synchronous scheduling: the last token's row never ran
    mm["hidden_states"]["layers"] = {
        k: [v[: len(prompt)], v[len(prompt) : computed]] for k, v in mm["hidden_states"]["layers"].items()
    }
    cut = edges.first_rows(mm, len(prompt) + spoken, len(prompt))
    assert cut["embed.tts_pad"].shape == (1, 1, HIDDEN)  # the request's own value, not a row per position
    info = from_handoff(qwen3_thinker_handoff(prompt, [*output[:spoken], 151645], cut))
    whole = torch.cat(mm["hidden_states"]["layers"][ACCEPT_LAYER])
    assert info["hidden_states"]["output"].shape[0] == len(prompt) + spoken
    assert torch.equal(info["hidden_states"]["output"], whole[: len(prompt) + spoken])
    assert info["ids"]["all"] == [*prompt, *output[:spoken], 151645]


def test_merged_outputs_keep_the_newest_multimodal_output():
    """A request's outputs merge when its reader falls behind (load): vLLM merges the tokens, the engine's
    collector keeps the newest multimodal output (vLLM-Omni's accumulation: the thinker's last rows and,
    at the finish, the consolidated tensors); vLLM's own kept the first one's."""
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import RequestOutputKind

    from omni_serve.engines.vllm_omni.engine import output_collector

    def step(tokens: list[int], rows: int, finished: bool) -> RequestOutput:
        completion = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None)
        completion.multimodal_output = {"hidden_states": {"layers": {0: torch.zeros(rows, HIDDEN)}}}
        return RequestOutput("r", None, [1, 2], None, [completion], finished)

    async def read(collector: Any) -> RequestOutput:
        return await collector.get()

    collector = output_collector()(RequestOutputKind.DELTA, "r")
    for i, rows in enumerate((2, 3, 4)):
        collector.put(step([10 + i], rows, finished=i == 2))
    merged = asyncio.run(read(collector))
    assert merged.finished and merged.outputs[0].token_ids == [10, 11, 12]
    assert engine.multimodal_output(merged)["hidden_states"]["layers"][0].shape[0] == 4

    # A request failed (its input feed did) while the engine still had a step of it on the way: the step
    # is dropped, the error stays the request's outcome (this put raised in the engine's output pump,
    # which then failed every request of the engine).
    failed = output_collector()(RequestOutputKind.DELTA, "r")
    failed.put(step([10], 2, finished=False))
    failed.put(EngineError("input stream failed"))
    failed.put(step([11], 3, finished=False))
    with pytest.raises(EngineError, match="input stream failed"):
        asyncio.run(read(failed))


def test_qwen3_tts_talker_to_code2wav_through_its_declared_processors():
    """A pipeline omni_serve has no hooks for, through the same machinery: Qwen3-TTS's talker hands code2wav its
    codec frames by its declared talker2code2wav_full_payload, and streamed by talker2code2wav_async_chunk cut
    with its deploy config's connector settings; code2wav's prompt comes from its declared
    talker2code2wav_token_only, the payload applied as vLLM-Omni's generation scheduler applies it."""
    import yaml

    from omni_serve.graph.generator import deploy_dir

    frames = 40
    codes = torch.randint(1, 2048, (frames, GROUPS), generator=torch.Generator().manual_seed(3))
    output_ids = [*codes[:, 0].tolist(), 2150]  # the last sampled token (the codec EOS) has no frame
    payload = producer("qwen3_tts", 0, hf_config=None).whole("r", [0] * 5, output_ids, {}, rows={"codes.audio": codes})
    assert payload is not None and payload.kind == "vllm_omni.qwen3_tts.talker2code2wav_full_payload"
    prompt = consumer("qwen3_tts", 1, through_object_store(payload))
    assert prompt["prompt_token_ids"] == codes.transpose(0, 1).reshape(-1).tolist()  # codebook-major

    extra = yaml.safe_load((deploy_dir() / "qwen3_tts.yaml").read_text())["connectors"]["connector_of_shared_memory"]
    chunker = producer("qwen3_tts", 0, hf_config=None, **extra["extra"]).chunks("r", (), stop_token_ids=[2150])
    steps = [chunker.push({"codes": {"audio": list(codes[: i + 1].split(1))}}, [], False) for i in range(frames)]
    steps.append(chunker.push({"codes": {"audio": codes}}, [], finished=True))
    chunks = [through_object_store(c) for step in steps for c in step]
    assert {c.kind for c in chunks} == {"vllm_omni.qwen3_tts.talker2code2wav_async_chunk"} and len(chunks) > 2
    context = extra["extra"]["codec_left_context_frames"]
    decoded: list[torch.Tensor] = []
    for chunk in chunks:  # no empty end marker: a stateless code2wav call has nothing to free
        prompt = consumer("qwen3_tts", 1, chunk)
        ids = torch.tensor(prompt["prompt_token_ids"]).reshape(GROUPS, -1).transpose(0, 1)
        left = prompt.get("additional_information", {}).get("meta", {}).get("left_context_size", 0)
        # vLLM-Omni's processor ships only new frames (its code2wav keeps state per request); each chunk here
        # carries the frames before it, up to the deploy's left context, which code2wav cuts itself.
        start = sum(len(d) for d in decoded)
        assert left == min(start, context) and torch.equal(ids[:left], codes[start - left : start])
        decoded.append(ids[left:])
    assert len(decoded[0]) == extra["extra"]["initial_codec_chunk_frames"]  # the first audio does not wait
    assert torch.equal(torch.cat(decoded), codes)  # every frame once, in order

    # A clone: the first chunk leads with the reference's codes as its left context (as the processor cuts it),
    # the next ones with the reference's codes and the talker's frames before them (as the whole decode has them).
    ref = torch.randint(1, 2048, (6, GROUPS), generator=torch.Generator().manual_seed(4))
    chunker = producer("qwen3_tts", 0, hf_config=None, **extra["extra"]).chunks("c", (), stop_token_ids=[2150])
    grown = [{"codes": {"audio": list(codes[: i + 1].split(1)), "ref": ref}} for i in range(30)]
    steps = [chunker.push(output, [], False) for output in grown]
    first, second = (consumer("qwen3_tts", 1, through_object_store(c)) for step in steps for c in step)
    ids = torch.tensor(first["prompt_token_ids"]).reshape(GROUPS, -1).transpose(0, 1)
    assert first["additional_information"]["meta"]["left_context_size"] == 6 and torch.equal(ids[:6], ref)
    ids = torch.tensor(second["prompt_token_ids"]).reshape(GROUPS, -1).transpose(0, 1)
    assert second["additional_information"]["meta"]["left_context_size"] == 7
    assert torch.equal(ids, torch.cat([ref, codes[:26]]))


def test_qwen3_tts_chunks_take_only_valid_frames_as_the_engine_outputs_them():
    """The talker's outputs as vLLM-Omni's engine accumulates them (DELTA: the prompt's rows after the prefill,
    then a growing list of one-row parts, one consolidated tensor at the finish), with its per-row
    ``meta.codec_frame_valid`` (the prompt's rows are not frames): the chunks hold every generated frame once,
    none of the prompt's rows (the engine's step rows split the flag as they split the frames)."""
    import yaml

    from omni_serve.graph.generator import deploy_dir

    prompt, frames = 7, 30
    codes = torch.randint(1, 2048, (frames, GROUPS), generator=torch.Generator().manual_seed(5))
    placeholders = torch.zeros(prompt, GROUPS, dtype=torch.long)
    extra = yaml.safe_load((deploy_dir() / "qwen3_tts.yaml").read_text())["connectors"]["connector_of_shared_memory"]
    chunker = producer("qwen3_tts", 0, hf_config=None, **extra["extra"]).chunks("v", [0] * prompt, [2150])

    def output(parts: list[torch.Tensor], valid: list[torch.Tensor]) -> dict[str, Any]:
        return {"codes": {"audio": parts}, "meta": {"codec_frame_valid": valid, "codec_streaming": valid}}

    parts, valid = [placeholders], [torch.zeros(prompt, dtype=torch.bool)]
    steps = [chunker.push(output(parts[0], valid[0]), [1], False)]  # the prefill: one tensor
    for i in range(frames - 1):
        parts, valid = [*parts, codes[i : i + 1]], [*valid, torch.ones(1, dtype=torch.bool)]
        steps.append(chunker.push(output(list(parts), list(valid)), [1] * (i + 2), False))
    whole = output(torch.cat([placeholders, codes]), torch.cat([valid[0], torch.ones(frames, dtype=torch.bool)]))
    steps.append(chunker.push(whole, [1] * (frames + 1), True))
    decoded = []
    for chunk in (through_object_store(c) for step in steps for c in step):
        prompt_of = consumer("qwen3_tts", 1, chunk)
        ids = torch.tensor(prompt_of["prompt_token_ids"]).reshape(GROUPS, -1).transpose(0, 1)
        left = prompt_of.get("additional_information", {}).get("meta", {}).get("left_context_size", 0)
        decoded.append(ids[left:])
    assert [len(d) for d in decoded] == [1, 25, 4]  # the deploy's first chunk, then 25, then the rest at the end
    assert torch.equal(torch.cat(decoded), codes)


@pytest.mark.parametrize("first_read", [1, 4], ids=["prefill-alone", "prefill-read-with-3-steps"])
def test_voxtral_chunks_carry_every_frame_once_with_their_context(first_read: int):
    """Voxtral's LM has a row a generated frame (``[1, 1, 37]`` a step) and none for its prompt, unlike Qwen3-TTS's
    talker: the prefill's call gets one frame, whether the engine's first output holds the prefill alone or
    more steps read late. Its processor (``generator2tokenizer_async_chunk``) heads each chunk with its context
    and new frame counts; the audio tokenizer's prompt, decoded the same way, gives every frame once, in the
    deploy config's chunks (5 at the beginning, then 25; 25 frames of context). Fails with all of a late first
    read's frames handed to one processor call ('expected sequence of length 37 ... (got 148)')."""
    import yaml

    from omni_serve.graph.generator import deploy_dir

    prompt, frames, width = 30, 24, 37
    codes = torch.randint(2, 8192, (frames, width), generator=torch.Generator().manual_seed(6))
    extra = yaml.safe_load((deploy_dir() / "voxtral_tts.yaml").read_text())["connectors"]["connector_of_shared_memory"]
    chunker = producer("voxtral_tts", 0, hf_config=None, **extra["extra"]).chunks("x", [0] * prompt)
    parts = [codes[i].reshape(1, 1, width) for i in range(frames)]
    steps = [chunker.push({"codes": {"audio": parts[:first_read]}}, [5] * first_read, False)]
    for n in range(first_read + 1, frames):
        steps.append(chunker.push({"codes": {"audio": parts[:n]}}, [5] * n, False))
    steps.append(chunker.push({"codes": {"audio": torch.cat(parts)}}, [5] * frames, True))
    sizes, decoded = [], []
    for chunk in (through_object_store(c) for step in steps for c in step):
        ids = consumer("voxtral_tts", 1, chunk)["prompt_token_ids"]
        context, new = ids[0], ids[1]
        window = torch.tensor(ids[2:]).reshape(context + new, width)
        done = sum(sizes)
        assert context == min(25, done) and torch.equal(window[:context], codes[done - context : done])
        sizes.append(new)
        decoded.append(window[context:])
    assert sizes == [5, 5, 5, 5, 4]
    assert torch.equal(torch.cat(decoded), codes)


def test_glm_image_ar_to_dit_through_ar2diffusion():
    """GLM-Image's AR output (handed on as it is: its stage declares no producer processor) with the request's
    prompt, pickled as the object store does, becomes the DiT's request by vLLM-Omni's own ar2diffusion: the
    preview grid skipped, the image's 2x2 tokens upsampled to 4x4, the size and the image to edit from the prompt."""
    from PIL import Image

    ar = pipelines.stage("glm_image", 0)
    dit = pipelines.stage("glm_image", 1)
    tokens = list(range(1000, 1000 + 16 * 16 + 2 * 2)) + [16385]  # preview, image, EOS (64x64: 16x16 + 2x2 + 1)
    handoff = producer("glm_image", 0, SimpleNamespace()).whole("r1", [1, 2, 3], tokens, {})
    assert handoff.kind == edges.SOURCE_OUTPUT
    prompt = {"prompt": "a red fox", "modalities": ["image"], "mm_processor_kwargs": {"target_h": 64, "target_w": 64}}
    made = edges.diffusion_input(
        dit, [pickle.loads(pickle.dumps(edges.with_entry_prompt(handoff, prompt, 42)))], request_id="r1"
    )
    assert (made["prompt"], made["height"], made["width"]) == ("a red fox", 64, 64)
    image_tokens = tokens[256:260]
    expected = torch.tensor(image_tokens).view(1, 1, 2, 2).repeat_interleave(2, 2).repeat_interleave(2, 3).view(-1)
    assert torch.equal(made["extra"]["prior_token_ids"], expected) and made["extra"]["prior_token_image_ids"] is None
    assert "pil_image" not in made  # no image to edit

    source = np.zeros((64, 96, 3), dtype=np.uint8)
    source[:, :48] = (200, 10, 10)
    edit = {**prompt, "modalities": ["img2img"], "multi_modal_data": {"img2img": Image.fromarray(source)}}
    prior = torch.arange(64)  # the source image's tokens, as the AR's model writes them for the DiT
    edited = producer("glm_image", 0, SimpleNamespace()).whole("r2", [1, 2], tokens, {"ids": {"prior_image": prior}})
    carried = pickle.loads(pickle.dumps(edges.with_entry_prompt(edited, edit, 7)))
    assert carried.meta["seed"] == 7 and "entry_prompt.img2img" in carried.tensors  # the image, by reference
    made = edges.diffusion_input(dit, [carried], request_id="r2")
    assert np.array_equal(np.asarray(made["pil_image"]), source)
    assert torch.equal(made["extra"]["prior_token_image_ids"][0], prior)
    assert set(edges.source_output(carried, "r2").multimodal_output) == {"ids"}  # the image is the prompt's, not output
    assert ar.custom_process_next_stage_input_func is None and dit.input_sources == (0,)


def test_glm_image_too_few_ar_tokens_make_no_dit_request():
    """ar2diffusion makes nothing of an AR output too short for the size: a clear error, not a DiT call."""
    handoff = producer("glm_image", 0, SimpleNamespace()).whole("r", [1], [5, 6, 7], {})
    prompt = {"prompt": "x", "modalities": ["image"], "mm_processor_kwargs": {"target_h": 64, "target_w": 64}}
    with pytest.raises(ValueError, match="made no DiT request"):
        edges.diffusion_input(
            pipelines.stage("glm_image", 1), [edges.with_entry_prompt(handoff, prompt)], request_id="r"
        )
