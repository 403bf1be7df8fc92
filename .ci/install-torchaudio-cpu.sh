#!/usr/bin/env bash
# torchaudio's pure-Python part for the CPU torch==2.13.0: vLLM-Omni imports torchaudio at module level in code the
# new model families run (vllm_omni/utils/audio.py: Qwen3-TTS's talker builds its speaker-encoder mel filters with
# torchaudio.functional.melscale_fbanks; the speech server's audio_utils_mixin.py resamples with it). PyPI has no
# torchaudio for torch 2.13 (the newest is 2.11.0, a CUDA build pinned to torch==2.11.0; PyTorch publishes CPU
# builds on its own index only). --no-deps installs that one wheel and nothing else; .ci/torchaudio_cpu.py then
# removes its three CUDA extension libraries, which cannot load over the CPU torch, so torchaudio takes its own
# "extension not present" path (torchaudio/_extension/utils.py `_load_lib`), checks that the functions vLLM-Omni
# uses work and that the extension-only ops fail loudly. Idempotent. Used by .ci/install-vllm-cpu.sh.
#
# Usage: .ci/install-torchaudio-cpu.sh     (PYTHON=/path/to/python to pick the interpreter)
set -euo pipefail

PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

"$PYTHON" "$HERE/torchaudio_cpu.py" --installed \
  || "$PYTHON" -m pip install --disable-pip-version-check --quiet --only-binary=:all: --no-deps torchaudio==2.11.0
"$PYTHON" "$HERE/torchaudio_cpu.py"
