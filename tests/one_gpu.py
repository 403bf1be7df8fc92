"""graphs/tiny_omni_vllm.yaml packed onto one GPU: the vLLM-Omni production path at the tiny size.

The shipped file is the CPU graph. What differs on a GPU is declared here once, for the GPU test
(``tests/test_vllm_omni_gpu.py``) and the benchmarks' GPU mode (``benchmarks/vs_vllm_omni.py --gpu``,
``benchmarks/bench.py --gpu``):

- every stage in bfloat16 (FlashAttention 3, vLLM's attention on Hopper, has no float32; the CPU
  graph's thinker runs float32);
- each stage a fraction of the one GPU (Ray's ``num_gpus``: thinker 0.3, talker 0.3, code2wav 0.2) and
  its engine's ``gpu_memory_utilization`` the same fraction, as ``graphs/qwen3_omni.yaml`` pairs them;
  vLLM sizes the KV cache from it (the CPU graph's fixed ``kv_cache_memory_bytes`` is dropped);
- the schedulers ``graphs/qwen3_omni.yaml`` runs: async scheduling for thinker and talker (vLLM's CPU
  platform turns it off, hence the CPU graph's synchronous scheduler), and ``moe_backend: triton``
  (what vLLM-Omni picks for Qwen3-Omni on CUDA; the CPU graph's ``auto`` selects CPU experts);
- one fixed replica per stage (a second one would not fit the GPU's shares).

``enforce_eager`` stays on (``eager=False`` turns it off): stages start in seconds instead of compiling
and capturing CUDA graphs of each stage model. vLLM-Omni's talker code predictor compiles itself with
``torch.compile`` on CUDA whatever this says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.conftest import Mutate, graph_variant

GRAPH = "tiny_omni_vllm.yaml"
SHARES: dict[str, float] = {"thinker": 0.3, "talker": 0.3, "code2wav": 0.2}
DTYPE = "bfloat16"
AR_STAGES = ("thinker", "talker")  # autoregressive: vLLM's AR scheduler; code2wav is a generation stage
# Engine keys of the CPU graph that do not apply on a GPU (see the module docstring).
CPU_ONLY = ("kv_cache_memory_bytes",)


def stage_engine(stage: str, share: float, *, eager: bool = True) -> dict[str, Any]:
    """The engine settings one stage gets on the GPU (merged into its ``engine_args.engine``)."""
    engine: dict[str, Any] = {
        "dtype": DTYPE,
        "gpu_memory_utilization": share,
        "enforce_eager": eager,
    }
    if stage in AR_STAGES:
        # async_scheduling picks the pipeline's async AR scheduler (vLLM-Omni's merge_pipeline_deploy: the
        # scheduler is the declaration's, not a deploy setting).
        engine |= {"async_scheduling": True, "moe_backend": "triton"}
    return engine


def one_gpu(shares: Mapping[str, float] = SHARES, *, eager: bool = True) -> Mutate:
    """The ``mutate`` that turns the CPU graph into its one-GPU variant (``Graphs.deploy``, ``deploy_graph_file``)."""
    if set(shares) != set(SHARES):
        raise KeyError(f"shares: one per stage {sorted(SHARES)}, got {sorted(shares)}")
    variant = graph_variant(
        fixed_replicas=1,
        deployments={stage: {"ray_actor_options": {"num_gpus": share}} for stage, share in shares.items()},
        engine_args={stage: {"engine": stage_engine(stage, share, eager=eager)} for stage, share in shares.items()},
    )

    def mutate(config: dict[str, Any]) -> None:
        variant(config)
        for stage in config["applications"][0]["args"]["stages"]:
            for key in CPU_ONLY:
                stage["engine_args"]["engine"].pop(key, None)

    return mutate


def gpu_config(shares: Mapping[str, float] = SHARES, *, eager: bool = True) -> dict[str, Any]:
    """The variant's whole Serve config, as ``serve run`` gets it."""
    from omni_serve.cli.launch import load_graph_file

    config = load_graph_file(GRAPH)
    one_gpu(shares, eager=eager)(config)
    return config


def stages(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Stage name -> its graph entry (``engine_args``, sampling, ...)."""
    return {stage["name"]: stage for stage in config["applications"][0]["args"]["stages"]}


def gpu_shares(config: dict[str, Any]) -> dict[str, float]:
    """Deployment name -> the GPUs Ray gives each of its replicas (deployments that ask for none left out)."""
    return {
        d["name"]: float(d["ray_actor_options"]["num_gpus"])
        for d in config["applications"][0]["deployments"]
        if d.get("ray_actor_options", {}).get("num_gpus")
    }
