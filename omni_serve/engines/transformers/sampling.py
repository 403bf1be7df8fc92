"""HF ``generate`` settings of one call: its seed, generation config, end ids and stopping criteria."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any

from omni_serve.pacing import StepPacer
from omni_serve.types import SamplingParams


def seed(sampling: SamplingParams) -> int:
    return sampling.seed if sampling.seed is not None else secrets.randbits(63)


def generation_config(s: SamplingParams, **fields: Any) -> Any:
    """One call's ``GenerationConfig``: ``s`` (:func:`sampling_kwargs`) and ``fields``.

    Passed to ``generate`` as ``generation_config`` rather than as keyword arguments: given none,
    transformers 5.14.1's ``_prepare_generation_config`` first checks the model config for stray
    generation settings (``PreTrainedConfig._get_generation_parameters``) by building a default
    instance of the whole config class, 4.7 ms per call for the thinker and 3.8 ms for the talker
    on the CPU box, spent before the first token. The resulting settings are the same: the
    checkpoint's ``generation_config`` still fills what is left unset.
    """
    from transformers import GenerationConfig

    return GenerationConfig(**sampling_kwargs(s), **fields)


def sampling_kwargs(s: SamplingParams) -> dict[str, Any]:
    """HF ``generate`` settings for ``s``.

    ``top_k`` 1 keeps only the most likely token whatever the temperature, top-p or min-p, so it
    decodes greedily: the same tokens without HF's sampling path, which sorts (top-p) and draws
    (multinomial) over the whole vocabulary at every step (half the tiny thinker's CPU with its
    152k-token vocabulary, measured with py-spy).
    """
    sample = s.temperature > 0 and s.top_k != 1
    kwargs: dict[str, Any] = {"do_sample": sample}
    if s.repetition_penalty != 1.0:  # 1.0 is HF's no-op; passing it only draws a warning with inputs_embeds
        kwargs["repetition_penalty"] = s.repetition_penalty
    if s.logit_bias:  # OpenAI's logit_bias is HF's bias of one-token sequences, added to the logits before sampling
        kwargs["sequence_bias"] = {(int(token),): float(bias) for token, bias in s.logit_bias.items()}
    if sample:
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)  # top_k 0: HF adds no filter
        if s.min_p > 0:
            kwargs["min_p"] = s.min_p
    return kwargs


def end_ids(eos_ids: list[int], stop_token_ids: set[int], ignore_eos: bool) -> list[int]:
    """The token ids that end a generation: the model's EOS tokens unless ``ignore_eos``, and the stop ids.

    An empty list (``ignore_eos`` without stop ids) overrides the checkpoint's generation config, so
    ``generate`` then runs to ``max_new_tokens``.
    """
    return sorted(stop_token_ids if ignore_eos else set(eos_ids) | stop_token_ids)


def stopping(
    cancelled: threading.Event,
    min_step_s: float,
    extra: Callable[[], bool] | None = None,
    before_next: Callable[[], None] | None = None,
) -> Any:
    """HF stopping criteria, run after every decoding step: paced (``min_step_s``), then stop on abort or
    ``extra``; ``before_next`` waits for what the next step needs (the next step's time counts from then)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    pacer = StepPacer(min_step_s, cancelled)

    class _Flag(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            import torch

            pacer.step_done()
            if before_next is not None:
                before_next()
                pacer.step_started()
            stop = cancelled.is_set() or (extra is not None and extra())
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Flag()])
