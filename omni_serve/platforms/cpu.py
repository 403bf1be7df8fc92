"""vLLM-Omni on CPU: an ``OmniPlatform`` over vLLM's ``CpuPlatform``.

vLLM's ``CpuPlatform`` supplies everything vLLM needs (CPU attention, gloo, memory,
config fix-ups: no CUDA graphs, no async scheduling; vLLM keeps resolving its own
``current_platform`` to it, so its hooks are not overridden here); ``OmniPlatform`` adds what
vLLM-Omni asks a platform for: its AR and generation stage workers
(:mod:`omni_serve.platforms.cpu_worker`), the torch device and memory queries, and the
diffusion attention backend (torch SDPA).
"""

from __future__ import annotations

from typing import Any

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

WORKERS = "omni_serve.platforms.cpu_worker"
CPU_SDPA = "omni_serve.platforms.cpu_attention.CPUSDPABackend"  # torch SDPA, with a CPU forward


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return f"{WORKERS}.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return f"{WORKERS}.CPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/model_executor/stage_configs"

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        if selected_backend is not None and selected_backend.upper() not in ("TORCH_SDPA", "SDPA"):
            cls.validate_diffusion_attn_backend(selected_backend.upper())
            return DiffusionAttentionBackendEnum[selected_backend.upper()].get_path()
        return CPU_SDPA

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        pass

    # Allocator calls vLLM-Omni's diffusion worker and runner make around each request; vLLM's platform
    # forwards unknown names to ``torch.cpu``, which has none of them (and then returns None, which the
    # caller calls). CPU memory has no allocator cache to empty and no peak counters: nothing to reset, 0.
    @classmethod
    def empty_cache(cls) -> None:
        pass

    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        pass

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def get_free_memory(cls, device: Any = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: Any = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total
