"""Qwen3-Omni handoffs on real tiny tensors: payloads, talker inputs identical to HF's, codec chunks."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch

from omni_serve.checkpoints.tiny_omni import ensure_tiny_omni
from omni_serve.models import codec
from omni_serve.models import qwen3_omni as q
from omni_serve.payload import HandoffPayload
from tests.vocoder import SAMPLES_PER_FRAME, hf_lag

# Measured on the tiny checkpoint, random codes (4 seeds x 75/100 frames), chunks of 25 (or a
# first chunk of 4) with 25 frames of left context, against one decode of all frames: max |diff|
# 0.0065-0.017 at peaks of 0.40-0.55, relative RMS error 0.8-1.9% (seed 0, 75 frames: 0.0091,
# 1.1%). The residue is code2wav's 72-frame attention window reaching past the 25-frame context.
CHUNKED_MAX_ABS = 0.03
CHUNKED_REL_RMS = 0.03


@pytest.fixture(scope="module")
def model() -> Any:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(ensure_tiny_omni()).eval()


@pytest.fixture(scope="module")
def bf16_model() -> Any:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(ensure_tiny_omni(), dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_omni())


def _prompt(tokenizer: Any, messages: list[dict]) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")[
        "input_ids"
    ]


def _thinker_payload(model: Any, input_ids: torch.Tensor, max_new_tokens: int) -> HandoffPayload:
    cfg = model.config
    with torch.inference_mode():
        out = model.thinker.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=[cfg.im_end_token_id],
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
        layer = cfg.talker_config.accept_hidden_layer
        tts_ids = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
        return q.build_thinker2talker(
            out.sequences[0].tolist(),
            input_ids.shape[1],
            q.thinker_states(out.hidden_states, 0),
            q.thinker_states(out.hidden_states, layer),
            model.thinker.get_input_embeddings()(tts_ids),
            layer,
        )


def test_thinker2talker_payload(model: Any, tokenizer: Any) -> None:
    input_ids = _prompt(tokenizer, [{"role": "user", "content": "Hello!"}])
    payload = _thinker_payload(model, input_ids, max_new_tokens=6)
    t = payload.tensors
    prompt_len = input_ids.shape[1]
    hidden_size = model.config.thinker_config.text_config.hidden_size
    assert payload.kind == q.THINKER2TALKER
    assert payload.meta == {"prompt_len": prompt_len, "num_generated": 6, "accept_hidden_layer": 1, "dtypes": {}}
    assert t["token_ids"].dtype == np.int64 and t["token_ids"].shape == (prompt_len + 6,)
    assert t["token_ids"][:prompt_len].tolist() == input_ids[0].tolist()
    # HF never runs the last sampled token through the thinker: one row fewer than tokens.
    assert t["embeds"].shape == t["hidden"].shape == (prompt_len + 5, hidden_size)
    assert t["embeds"].dtype == t["hidden"].dtype == np.float32
    assert t["tts_embeds"].shape == (3, hidden_size)
    # Layer 0 is the token embedding itself.
    emb = model.thinker.get_input_embeddings()(torch.as_tensor(t["token_ids"][: prompt_len + 5])).detach().numpy()
    np.testing.assert_array_equal(t["embeds"], emb)


CONVERSATIONS = [
    [{"role": "user", "content": "Say something."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again, ünïcödé"},
    ],
]


@pytest.mark.parametrize("model_fixture", ["model", "bf16_model"], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["single-turn", "system+history"])
def test_talker_inputs_equal_hf(
    request: pytest.FixtureRequest, model_fixture: str, tokenizer: Any, messages: list[dict]
) -> None:
    """Our talker inputs are bit-identical to what HF's own generate() feeds its talker, in fp32 and bf16."""
    model = request.getfixturevalue(model_fixture)
    input_ids = _prompt(tokenizer, messages)
    captured: dict[str, torch.Tensor] = {}

    def capture(module: Any, args: Any, kwargs: dict) -> None:
        if not captured:  # the prefill call carries the full inputs
            captured.update({k: kwargs[k] for k in ("inputs_embeds", "trailing_text_hidden", "tts_pad_embed")})
            captured["talker_input_ids"] = kwargs["talker_input_ids"]

    hook = model.talker.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model.generate(
            input_ids,
            speaker="chelsie",
            thinker_max_new_tokens=8,
            thinker_eos_token_id=[model.config.im_end_token_id],
            talker_max_new_tokens=2,
            talker_repetition_penalty=1.0,  # HF warns about a penalty with inputs_embeds otherwise
        )
    finally:
        hook.remove()

    payload = _thinker_payload(model, input_ids, max_new_tokens=8)
    if model.dtype == torch.bfloat16:  # bf16 stays 2 bytes a value on the wire, never widened
        floats = ("embeds", "hidden", "tts_embeds")
        assert payload.meta["dtypes"] == dict.fromkeys(floats, "bfloat16")
        assert all(payload.tensors[name].dtype == np.int16 for name in floats)
    payload = pickle.loads(pickle.dumps(payload, protocol=5))  # what crossing the object store does
    for array in payload.tensors.values():
        array.flags.writeable = False  # as numpy arrays come out of Ray's object store
    with torch.inference_mode():
        ours = q.build_talker_inputs(payload, model.talker, model.config, q.speaker_id(model.config, "Chelsie"))
    assert ours is not None
    for name in ("inputs_embeds", "tts_pad_embed"):
        assert torch.equal(ours.as_kwargs(q.TrailingText(ours, 1))[name], captured[name]), name
    # HF's trailing text is the reply's rows then tts_eos; TrailingText adds tts_pad rows for the
    # steps past it, which is what HF adds there.
    hf_trailing = captured["trailing_text_hidden"]
    assert torch.equal(torch.cat((ours.trailing_rows, ours.tts_eos_embed), dim=1), hf_trailing)
    trailing = q.TrailingText(ours, hf_trailing.shape[1] + 3)
    trailing.finish()
    assert torch.equal(trailing.buffer[:, : hf_trailing.shape[1]], hf_trailing)
    assert torch.equal(trailing.buffer[:, hf_trailing.shape[1] :], captured["tts_pad_embed"].expand(1, 3, -1))


def test_speaker_id(model: Any) -> None:
    assert q.speaker_id(model.config, None) == model.config.talker_config.speaker_id["ethan"]
    assert q.speaker_id(model.config, "AIDEN") == model.config.talker_config.speaker_id["aiden"]
    with pytest.raises(KeyError, match="aiden.*chelsie.*ethan"):
        q.speaker_id(model.config, "nobody")


def test_suppressed_codec_ids(model: Any) -> None:
    tcfg = model.config.talker_config
    suppressed = q.talker_suppress_tokens(model.config)
    assert len(suppressed) == 1023 and tcfg.codec_eos_token_id not in suppressed
    assert min(suppressed) == model.config.code2wav_config.codebook_size


def _codes(frames: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 128, size=(16, frames), dtype=np.int64)


def test_chunks_carry_their_left_context() -> None:
    codes = _codes(57)
    chunks = codec.chunk_codec_codes(codes, first_chunk_frames=4, chunk_frames=10, left_context_frames=25)
    assert [c.meta["num_frames"] for c in chunks] == [4, 10, 10, 10, 10, 10, 3]
    assert [c.meta["left_context"] for c in chunks] == [0, 4, 14, 24, 25, 25, 25]
    assert [c.meta["index"] for c in chunks] == list(range(7))
    for c in chunks:
        start, ctx, n = c.meta["start_frame"], c.meta["left_context"], c.meta["num_frames"]
        assert c.kind == codec.CODEC_CHUNK and c.tensors["codes"].dtype == np.int64
        np.testing.assert_array_equal(c.tensors["codes"], codes[:, start - ctx : start + n])

    # Frame-by-frame streaming cuts the same chunks as chunking everything at once.
    chunker = codec.CodecChunker(4, 10, 25)
    streamed = [c for i in range(codes.shape[1]) for c in chunker.push(codes[:, i])] + chunker.flush()
    assert [c.meta for c in streamed] == [c.meta for c in chunks]
    for a, b in zip(streamed, chunks, strict=True):
        np.testing.assert_array_equal(a.tensors["codes"], b.tensors["codes"])
    assert chunker.flush() == []


def _decode_all(model: Any, codes: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model.code2wav(torch.as_tensor(codes)[None])[0, 0].numpy()


def _joined(model: Any, chunks: list[HandoffPayload]) -> np.ndarray:
    waves = [q.decode_codec_chunk(model.code2wav, c) for c in chunks]
    assert all(w.dtype == np.float32 and w.ndim == 1 for w in waves)
    return np.concatenate(waves)


def test_joined_chunks_match_full_decode(model: Any) -> None:
    codes = _codes(75)
    full = _decode_all(model, codes)
    assert full.shape == (75 * SAMPLES_PER_FRAME - hf_lag(model.code2wav),)  # the lag does not grow with length

    # With every earlier frame as context, chunking is exact up to float noise.
    exact = _joined(model, codec.chunk_codec_codes(codes, 10, 40, left_context_frames=75))
    assert exact.shape == full.shape
    assert np.abs(exact - full).max() < 1e-5

    for first in (25, 4, 1):  # the default, and small first chunks for early audio (graphs/tiny_omni.yaml: 1)
        joined = _joined(model, codec.chunk_codec_codes(codes, first, 25, left_context_frames=25))
        assert joined.shape == full.shape
        err = joined - full
        assert np.abs(err).max() < CHUNKED_MAX_ABS
        assert np.sqrt(np.mean(err**2) / np.mean(full**2)) < CHUNKED_REL_RMS


def test_decode_rejects_other_payloads(model: Any) -> None:
    with pytest.raises(ValueError, match="codec_chunk"):
        q.decode_codec_chunk(model.code2wav, HandoffPayload(kind="other", tensors={}))
