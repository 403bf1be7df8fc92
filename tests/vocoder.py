"""The code2wav vocoder's lag, read from what measures it, never written down as a constant.

Code2wav's transposed convolutions hold back the last ``lag`` samples of a decode: ``n`` codec
frames give ``n * SAMPLES_PER_FRAME - lag`` samples. The vllm_omni engine measures ``lag`` when it
starts (one frame decoded alone) and reports it in its stage stats; the transformers family runs
HF's code2wav in process, and :func:`hf_lag` measures that module the same way.
"""

from __future__ import annotations

import functools
from typing import Any

SAMPLES_PER_FRAME = 1920  # Qwen3-Omni's codec: upsample_rates 8*5*4*3 x upsampling_ratios 2*2


def hf_lag(code2wav: Any) -> int:
    """The lag of an HF ``Qwen3OmniMoeCode2Wav`` module: what one frame decoded alone lacks of a whole frame."""
    import torch

    codes = torch.zeros((1, code2wav.config.num_quantizers, 1), dtype=torch.long, device=code2wav.device)
    with torch.inference_mode():
        samples = code2wav(codes).shape[-1]
    lag = int(code2wav.total_upsample) - samples
    assert 0 < lag < int(code2wav.total_upsample), f"a lone frame decoded to {samples} samples"
    return lag


@functools.cache
def tiny_lag() -> int:
    """The tiny Qwen3-Omni checkpoint's lag (the transformers family serves it in process): :func:`hf_lag` of a
    code2wav of its architecture. The lag is the transposed convolutions' geometry, not their weights, so a
    freshly initialised module of the checkpoint's ``code2wav_config`` measures it without loading the graph's."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from omni_serve.checkpoints.tiny_omni import tiny_config

    return hf_lag(Qwen3OmniMoeCode2Wav(tiny_config().code2wav_config).eval())


def served_lag(graphs: Any, stage: str = "code2wav") -> int:
    """The lag the deployed vllm_omni code2wav stage measured at start (its ``stats``' ``vocoder_lag``)."""
    lag = graphs.handle(stage).stats.remote().result()["vocoder_lag"]
    assert 0 < lag < SAMPLES_PER_FRAME, f"stage {stage} reports a vocoder lag of {lag}"
    return lag


def whole_frames(samples: int, lag: int) -> int:
    """Codec frames in a decode of ``samples`` samples; fails unless that is whole frames less the lag."""
    frames, rest = divmod(samples + lag, SAMPLES_PER_FRAME)
    assert rest == 0, f"{samples} samples are not whole {SAMPLES_PER_FRAME}-sample frames less the lag ({lag})"
    return frames
