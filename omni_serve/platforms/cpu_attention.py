"""vLLM-Omni's torch-SDPA diffusion attention, dispatched on CPU.

vLLM-Omni's diffusion attention implementations pick their forward by platform
(``AttentionImpl.forward``: ROCm, CUDA, NPU, XPU, MUSA) and raise ``NotImplementedError`` on any other,
so its ``SDPABackend`` cannot run on CPU although its body is plain
``torch.nn.functional.scaled_dot_product_attention``. This backend is that one, with the CPU case
added: the broadcast key mask CUDA uses (SDPA on CPU broadcasts it the same way). The CPU
platform (:mod:`omni_serve.platforms.cpu`) returns it for the default and for ``TORCH_SDPA``. No CPU
platform upstream: vllm-project/vllm-omni#1095 (open PR #4665).
"""

from __future__ import annotations

from typing import Any

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CPUSDPAImpl(SDPAImpl):
    def forward(self, query: Any, key: Any, value: Any, attn_metadata: Any = None) -> Any:
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CPUSDPABackend(SDPABackend):
    """vLLM-Omni's ``SDPABackend`` (name ``SDPA``, same head sizes and mask support) with a CPU forward."""

    @staticmethod
    def get_impl_cls() -> type[CPUSDPAImpl]:
        return CPUSDPAImpl
