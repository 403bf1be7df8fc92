"""Qwen3-Omni handoffs between thinker, talker and code2wav, as pure functions.

These turn one stage's outputs into the next stage's inputs with no I/O, so they can be
tested on CPU with real (tiny) tensors. The talker inputs follow, step by step, what
``Qwen3OmniMoeForConditionalGeneration.generate`` in transformers does between its
thinker and talker calls; the composition here is ours, the modules are transformers'.

Payloads:

- ``qwen3_omni.thinker2talker``: ``token_ids`` int64 [T] (prompt + generated),
  ``embeds`` [R, D] (thinker layer-0 embeddings), ``hidden`` [R, D] (the talker's
  ``accept_hidden_layer``), ``tts_embeds`` [3, D] (thinker embeddings of tts bos/eos/pad);
  R <= T is the number of positions the thinker ran (HF never runs the last sampled token).
  The float tensors keep the thinker's dtype (bf16 as 16-bit words, :mod:`omni_serve.graph.transport`).
  A prompt with media adds what the talker's 3D RoPE needs to place the media positions, as HF's
  ``generate`` hands it over: ``rope.image_grid_thw`` / ``rope.video_grid_thw`` int64 [n, 3],
  ``rope.video_second_per_grid`` float [n], ``rope.audio_feature_lengths`` int64 [n] (HF does not
  hand the talker ``use_audio_in_video``, so neither does this: the talker places the positions as
  in HF's ``generate``).
  Streamed (a stage's ``stream_input``): the same payload for the prompt's rows (and any reply rows
  already run), ``meta["streamed"]`` set, then ``qwen3_omni.thinker2talker.rows`` chunks of the
  ``embeds`` and ``hidden`` rows of the reply positions run since; the stream's end ends the reply
  (:class:`ThinkerRows`, :class:`TrailingText`).
- ``qwen3_omni.codec_chunk`` (:mod:`omni_serve.models.codec`): ``codes`` int64 [groups, left_context + frames]; meta
  ``left_context``, ``index``, ``start_frame``, ``num_frames``. Every chunk carries its own
  left context, so any code2wav replica decodes any chunk without state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_serve import payload as handoff
from omni_serve.models import codec
from omni_serve.payload import HandoffPayload

if TYPE_CHECKING:
    import torch

THINKER2TALKER = "qwen3_omni.thinker2talker"
THINKER2TALKER_ROWS = "qwen3_omni.thinker2talker.rows"
SAMPLE_RATE = 24000  # code2wav's output rate (1920 samples per codec frame)


# --- (0) the thinker's prompt with media ----------------------------------------------------

# Processor outputs the talker's RoPE needs too (HF's generate passes them to both models).
ROPE_INPUTS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid")


def rope_inputs(inputs: Any) -> dict[str, Any]:
    """From the processor's output: what the talker's RoPE needs of the media positions (HF's names)."""
    rope: dict[str, Any] = {k: inputs[k] for k in ROPE_INPUTS if inputs.get(k) is not None}
    if inputs.get("feature_attention_mask") is not None:
        rope["audio_feature_lengths"] = inputs["feature_attention_mask"].sum(-1)
    return rope


# --- (a) thinker -> talker -----------------------------------------------------------------


def thinker_states(hidden_states: Sequence[Sequence[torch.Tensor]], layer: int) -> torch.Tensor:
    """Concatenate one layer over the steps of ``generate(output_hidden_states=True)``: [R, D] (batch 0)."""
    import torch

    return torch.cat([step[layer][0] for step in hidden_states], dim=0)


def build_thinker2talker(
    token_ids: Sequence[int] | np.ndarray,
    prompt_len: int,
    embeds: torch.Tensor | np.ndarray,
    hidden: torch.Tensor | np.ndarray,
    tts_embeds: torch.Tensor | np.ndarray,
    accept_hidden_layer: int,
    rope: dict[str, Any] | None = None,
    streamed: bool = False,
) -> HandoffPayload:
    """The thinker's handoff for one request.

    ``token_ids``: prompt + generated ids; ``embeds``/``hidden``: [R, D] layer-0 and
    ``accept_hidden_layer`` states of the first R positions; ``tts_embeds``: [3, D] thinker
    input embeddings of (tts_bos, tts_eos, tts_pad); ``rope``: :func:`rope_inputs` of a prompt with media.
    """
    arrays, dtypes = handoff.arrays(
        {
            "token_ids": np.asarray(token_ids, dtype=np.int64).reshape(-1),
            "embeds": embeds,
            "hidden": hidden,
            "tts_embeds": tts_embeds,
            **{f"rope.{k}": v for k, v in (rope or {}).items()},
        }
    )
    rows = arrays["embeds"].shape[0]
    if arrays["hidden"].shape[0] != rows or rows > arrays["token_ids"].shape[0]:
        raise ValueError("embeds and hidden must cover the same leading positions of token_ids")
    if arrays["tts_embeds"].shape[0] != 3:
        raise ValueError("tts_embeds must hold (bos, eos, pad)")
    meta = {
        "prompt_len": int(prompt_len),
        "num_generated": int(arrays["token_ids"].shape[0] - prompt_len),
        "accept_hidden_layer": int(accept_hidden_layer),
        "dtypes": dtypes,
    }
    if streamed:  # the prompt's part of a streamed handoff: rows chunks follow (ThinkerRows)
        meta["streamed"] = True
    return HandoffPayload(kind=THINKER2TALKER, tensors=arrays, meta=meta)


# --- (b) talker inputs ---------------------------------------------------------------------


@dataclass
class TalkerInputs:
    """Keyword arguments for ``Qwen3OmniMoeTalkerForConditionalGeneration.generate`` (batch 1).

    ``trailing_rows`` are the reply's projected rows known so far, without HF's closing tts_eos
    (:class:`TrailingText` adds it when the thinker's reply is complete).
    """

    inputs_embeds: torch.Tensor  # [1, L, D_talker]
    trailing_rows: torch.Tensor  # [1, N, D_talker]: one per decoding step
    tts_pad_embed: torch.Tensor  # [1, 1, D_talker]
    tts_eos_embed: torch.Tensor  # [1, 1, D_talker]
    talker_input_ids: torch.Tensor  # [1, L]: for the talker's 3D RoPE index
    rope: dict[str, Any] = field(default_factory=dict)  # media positions for that index (HF's argument names)

    def as_kwargs(self, trailing: TrailingText) -> dict[str, Any]:
        return {
            "inputs_embeds": self.inputs_embeds,
            "trailing_text_hidden": trailing.buffer,
            "tts_pad_embed": self.tts_pad_embed,
            "talker_input_ids": self.talker_input_ids,
            **self.rope,
        }


class TrailingText:
    """What the talker adds to its input at each decoding step: the reply's rows as they arrive.

    HF's ``generate`` adds row ``step`` of ``trailing_text_hidden`` at decoding step ``step`` and
    tts_pad past its end; the reply's rows end with tts_eos. This holds a buffer of one row per
    step the talker may take, tts_pad until written: rows are written as the thinker produces them
    (:meth:`extend`), tts_eos after the last (:meth:`finish`). Step ``k`` may run once row ``k`` is
    written or the reply is complete (:meth:`ready`); the values it reads are then exactly HF's
    (adding a tts_pad row is adding ``tts_pad_embed``), whether the rows came at once or one by one.
    """

    def __init__(self, inputs: TalkerInputs, steps: int):
        self.buffer = inputs.tts_pad_embed.expand(1, steps, -1).clone()
        self.eos = inputs.tts_eos_embed
        self.rows = 0
        self.complete = False
        self.extend(inputs.trailing_rows)

    def extend(self, rows: torch.Tensor) -> None:
        room = max(0, self.buffer.shape[1] - self.rows)
        n = min(rows.shape[1], room)
        self.buffer[:, self.rows : self.rows + n] = rows[:, :n]
        self.rows += rows.shape[1]

    def finish(self) -> None:
        if self.rows < self.buffer.shape[1]:
            self.buffer[:, self.rows] = self.eos[:, 0]
        self.complete = True

    def ready(self, step: int) -> bool:
        return self.complete or step < self.rows


def speakers(config: Any) -> list[str]:
    """The talker's voice names (its config's ``speaker_id`` table), lower-cased and sorted."""
    return sorted(k.lower() for k in (config.talker_config.speaker_id or {}))


def speaker_id(config: Any, voice: str | None, default: str = "ethan") -> int:
    """Codec id of ``voice`` (case-insensitive); raises ``KeyError`` listing the valid voices."""
    speakers = {k.lower(): v for k, v in (config.talker_config.speaker_id or {}).items()}
    name = (voice or default).lower()
    if name not in speakers:
        raise KeyError(f"unknown voice {voice!r}; valid voices: {sorted(speakers)}")
    return int(speakers[name])


def build_talker_inputs(payload: HandoffPayload, talker: Any, config: Any, speaker: int) -> TalkerInputs | None:
    """Talker inputs from a whole thinker2talker payload (:func:`talker_inputs`; see there)."""
    if payload.kind != THINKER2TALKER:
        raise ValueError(f"expected a {THINKER2TALKER} payload, got {payload.kind}")
    return talker_inputs(ThinkerRows(payload), talker, config, speaker)


def talker_inputs(thinker: ThinkerRows, talker: Any, config: Any, speaker: int) -> TalkerInputs | None:
    """Talker inputs from a thinker2talker payload, as HF's ``generate`` builds them.

    ``talker`` is the ``Qwen3OmniMoeTalkerForConditionalGeneration`` and ``config`` the
    top-level ``Qwen3OmniMoeConfig``. Per ChatML segment (split at ``<|im_start|>`` in the
    prompt): system segments and earlier assistant turns are skipped; user segments become
    text-projected embeddings (hidden-projected accept-layer states at multimodal
    positions); the last assistant segment becomes 3 role tokens, 4 tts_pad, tts_bos and
    the first text token, plus codec (nothink, think_bos, think_eos, speaker, pad, bos)
    embeddings; the rest of its text feeds the talker one position per step
    (``trailing_text_hidden``, closed by tts_eos). Segments with any other role are skipped
    (HF raises). Returns ``None`` when the assistant turn has no text to speak (HF fails there).
    """
    import torch

    payload = thinker.first
    dev, dtype = talker.device, talker.dtype
    ids = handoff.tensor(payload, "token_ids", dev)[None]  # [1, T] int64
    embed = thinker.rows("embeds", dev)[None].to(dtype)  # [1, R, D]
    hidden = thinker.rows("hidden", dev)[None].to(dtype)
    prompt = ids[0, : payload.meta["prompt_len"]]
    mm_mask = _media_mask(ids, config)

    tts = talker.text_projection(handoff.tensor(payload, "tts_embeds", dev)[None].to(dtype))
    tts_bos, tts_eos, tts_pad = tts.chunk(3, dim=1)  # 3 x [1, 1, D_talker]

    # Segment bounds: every <|im_start|> of the prompt, then the end of the rows (the last segment is the
    # reply; HF slices it to the sequence's end, which is the same rows: R <= T).
    starts = torch.nonzero(prompt == config.im_start_token_id).flatten().tolist() + [embed.shape[1]]
    parts: list[torch.Tensor] = []
    part_ids: list[torch.Tensor] = []
    trailing = None
    for i in range(len(starts) - 1):
        a, b = starts[i], starts[i + 1]
        role = int(prompt[a + 1]) if a + 1 < prompt.shape[0] else -1
        if role == config.user_token_id:
            parts.append(_user_part(talker, embed, hidden, mm_mask, a, b))
            part_ids.append(ids[:, a:b])
        elif role == config.assistant_token_id and i == len(starts) - 2:
            reply = _assistant_part(talker, config, embed[:, a:b], tts_pad, tts_bos, speaker)
            if reply is None:
                return None
            part, trailing = reply
            parts.append(part)
            part_ids.append(torch.full((1, part.shape[1]), config.tts_pad_token_id, dtype=torch.long, device=dev))
        # system turns, earlier assistant turns and unknown roles carry nothing for the talker
    if trailing is None:
        raise ValueError("the thinker2talker payload has no final assistant turn")
    rope = {k.removeprefix("rope."): handoff.tensor(payload, k, dev) for k in payload.tensors if k.startswith("rope.")}
    return TalkerInputs(
        inputs_embeds=torch.cat(parts, dim=1),
        trailing_rows=trailing,
        tts_pad_embed=tts_pad,
        tts_eos_embed=tts_eos,
        talker_input_ids=torch.cat(part_ids, dim=1),
        rope=rope,
    )


def _media_mask(ids: torch.Tensor, config: Any) -> torch.Tensor:
    """Where ``ids`` [1, T] holds an audio, image or video placeholder (the positions of media rows)."""
    import torch

    mm_ids = (
        config.thinker_config.audio_token_id,
        config.thinker_config.image_token_id,
        config.thinker_config.video_token_id,
    )
    mm_mask = torch.zeros_like(ids, dtype=torch.bool)
    for mm in mm_ids:
        mm_mask |= ids == mm
    return mm_mask


def _assistant_part(
    talker: Any, config: Any, embed: torch.Tensor, tts_pad: torch.Tensor, tts_bos: torch.Tensor, speaker: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reply's segment of thinker embeddings ``embed`` [1, t, D] as the talker's prompt part (text
    projections plus the codec prefix), and its trailing text rows; None when it has no text to speak."""
    import torch

    tcfg = config.talker_config
    dev, dtype = talker.device, talker.dtype
    assistant = talker.text_projection(embed)  # [1, t, D]; t may be short by the last token
    if assistant.shape[1] < 4:
        return None
    text_part = torch.cat((assistant[:, :3], tts_pad.expand(-1, 4, -1), tts_bos, assistant[:, 3:4]), dim=1)
    codec_ids = torch.tensor(
        [
            [
                tcfg.codec_nothink_id,
                tcfg.codec_think_bos_id,
                tcfg.codec_think_eos_id,
                speaker,
                tcfg.codec_pad_id,
                tcfg.codec_bos_id,
            ]
        ],
        device=dev,
        dtype=torch.long,
    )
    codec_part = torch.cat(
        (
            torch.zeros((1, 3, tcfg.text_config.hidden_size), device=dev, dtype=dtype),
            talker.get_input_embeddings()(codec_ids),
        ),
        dim=1,
    )
    return text_part + codec_part, assistant[:, 4:]


def _user_part(
    talker: Any, embed: torch.Tensor, hidden: torch.Tensor, mm_mask: torch.Tensor, a: int, b: int
) -> torch.Tensor:
    import torch

    # Project the same row subsets HF projects, so the numbers match bit for bit.
    seg_mm = mm_mask[:, a:b]
    out = torch.empty((1, b - a, talker.config.text_config.hidden_size), device=embed.device, dtype=talker.dtype)
    if seg_mm.any():
        out[seg_mm] = talker.hidden_projection(hidden[:, a:b][seg_mm])
    out[~seg_mm] = talker.text_projection(embed[:, a:b][~seg_mm])
    return out


class ThinkerRows:
    """The thinker's handoff as the talker receives it: whole, or streamed in chunks.

    A streamed handoff is the thinker2talker payload of the prompt (``meta["streamed"]``: rows of the
    prompt and of the reply so far) followed by ``qwen3_omni.thinker2talker.rows`` chunks, each the
    ``embeds`` and ``hidden`` rows of the reply positions the thinker ran since; the stream's end is
    the reply's end. The talker can start once the reply's first row is there (:meth:`can_start`).
    """

    def __init__(self, first: HandoffPayload, im_start_token_id: int = -1):
        if first.kind != THINKER2TALKER:
            raise ValueError(f"expected a {THINKER2TALKER} payload first, got {first.kind}")
        self.first = first
        self.whole = not first.meta.get("streamed", False)
        self._chunks: dict[str, list[np.ndarray]] = {k: [first.tensors[k]] for k in ("embeds", "hidden")}
        self.count = first.tensors["embeds"].shape[0]
        token_ids = first.tensors["token_ids"]
        prompt = token_ids[: first.meta["prompt_len"]]
        im_start = np.flatnonzero(prompt == im_start_token_id) if not self.whole else np.zeros(0, np.int64)
        # The reply's first row is the 4th of the last segment (<|im_start|>, role, newline, then the reply).
        self._start_rows = int(im_start[-1]) + 4 if len(im_start) else 0

    def add(self, chunk: HandoffPayload) -> None:
        """Add a rows chunk received before the talker started (after, the rows go to :class:`TrailingText`)."""
        reply_rows(chunk)
        for k in self._chunks:
            self._chunks[k].append(chunk.tensors[k])
        self.count += chunk.tensors["embeds"].shape[0]

    def can_start(self) -> bool:
        return self.whole or self.count >= self._start_rows

    def rows(self, name: str, device: Any = None) -> torch.Tensor:
        """All ``name`` rows received, as one tensor of the thinker's dtype."""
        parts = self._chunks[name]
        if len(parts) > 1:
            parts[:] = [np.concatenate(parts)]
        return handoff.tensor(HandoffPayload(self.first.kind, {name: parts[0]}, self.first.meta), name, device)


def reply_rows(chunk: HandoffPayload) -> np.ndarray:
    """The ``embeds`` rows [n, D] of a streamed thinker handoff's rows chunk (all the talker adds per step)."""
    if chunk.kind != THINKER2TALKER_ROWS:
        raise ValueError(f"expected a {THINKER2TALKER_ROWS} chunk, got {chunk.kind}")
    return chunk.tensors["embeds"]


def thinker_rows_chunk(embeds: torch.Tensor, hidden: torch.Tensor) -> HandoffPayload:
    """A streamed thinker handoff's chunk: the rows of the reply positions the thinker ran since the last one."""
    arrays, dtypes = handoff.arrays({"embeds": embeds, "hidden": hidden})
    return HandoffPayload(kind=THINKER2TALKER_ROWS, tensors=arrays, meta={"dtypes": dtypes})


def merge_thinker_chunks(chunks: Sequence[HandoffPayload]) -> HandoffPayload:
    """Consecutive chunks of a streamed thinker handoff as one (the rows of the later ones appended to the first)."""
    if len(chunks) == 1:
        return chunks[0]
    first = chunks[0]
    tensors = dict(first.tensors)
    for k in ("embeds", "hidden"):
        tensors[k] = np.concatenate([c.tensors[k] for c in chunks])
    return HandoffPayload(first.kind, tensors, first.meta)


def project_rows(talker: Any, rows: torch.Tensor) -> torch.Tensor:
    """``talker.text_projection`` of reply rows [1, n, D] that arrive a few at a time, bit for bit as in one block.

    HF projects the whole reply in one call. On CPU, oneDNN/MKL multiply fewer than 4 rows on another
    code path whose sums round differently (measured on this build: blocks of 1-3 rows differ in the
    last bit from the same rows inside a larger block, blocks of 4 or more do not), so small blocks are
    padded to 4 rows and the padding dropped.
    """
    import torch

    n = rows.shape[1]
    if n >= 4:
        return talker.text_projection(rows)
    padded = torch.cat((rows, rows.new_zeros((1, 4 - n, rows.shape[2]))), dim=1)
    return talker.text_projection(padded)[:, :n]


def give_talker_the_audio_config(model: Any) -> None:
    """Let the talker place audio positions in its 3D RoPE (prompts with audio and an image or video).

    transformers 5.14's talker ``get_rope_index`` reads ``config.audio_config.n_window``, which
    ``Qwen3OmniMoeTalkerConfig`` does not have: HF's own ``generate(return_audio=True)`` raises
    AttributeError for such prompts (no upstream issue found). The audio tokens are the thinker's
    audio encoder's, so the talker is given the thinker's audio config, as the call expects.
    """
    talker_config = model.talker.config
    if not hasattr(talker_config, "audio_config"):
        talker_config.audio_config = model.config.thinker_config.audio_config


def talker_suppress_tokens(config: Any) -> list[int]:
    """The codec ids HF never lets the talker sample: the top 1024 of its vocab except codec EOS."""
    tcfg = config.talker_config
    vocab = tcfg.text_config.vocab_size
    return [i for i in range(vocab - 1024, vocab) if i != tcfg.codec_eos_token_id]


# --- (d) code2wav --------------------------------------------------------------------------


def decode_codec_chunk(code2wav: Any, payload: HandoffPayload) -> np.ndarray:
    """float32 mono waveform of one chunk, its left context trimmed.

    Code2wav is causal but its transposed convolutions hold back the last ``lag`` samples
    (555 for upsampling 8*5*4*3 * 2*2) until the next frame arrives: a decode of n frames
    yields ``n * upsample - lag`` samples. A chunk with left context therefore also emits
    the ``lag`` samples its predecessor could not, so the concatenated chunks line up
    sample for sample with one decode of all frames. (HF's ``chunked_decode`` drops them.)
    """
    import torch

    if payload.kind != codec.CODEC_CHUNK:
        raise ValueError(f"expected a {codec.CODEC_CHUNK} payload, got {payload.kind}")
    codes = torch.tensor(payload.tensors["codes"], dtype=torch.long, device=code2wav.device)[
        None
    ]  # copy: may be read-only
    ctx = int(payload.meta["left_context"])
    with torch.inference_mode():
        wav = code2wav(codes)[0, 0]
    return codec.trim_left_context(wav, codes.shape[-1], ctx, int(code2wav.total_upsample)).float().cpu().numpy()
