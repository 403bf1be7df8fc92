#!/usr/bin/env bash
# The project's checks on a lent GPU machine: call 4 (and 5) of the GPU kit (../shared/gpu-kit/README.md).
#
# Calls 1-3 of the kit extracted c1-c3 into /tmp/site; this extracts c4 when it was carried, checks
# the imports, builds the tiny checkpoints (no model hub there) and runs one phase, its logs in $OUT:
#
#   tests  (call 4: carry [".dev/c4"], timeout_s 560): tests/test_vllm_omni_gpu.py whole (its CPU checks,
#          then the vLLM-Omni graph on the GPU) and the gpu tests of tests/test_vllm_omni_diffusion.py (the
#          diffusion graph on the same GPU); ~5 min.
#   bench  (call 5, sent at once after call 4 so the machine is still warm: no carry, timeout_s 360):
#          benchmarks/vs_vllm_omni.py --gpu (omni_serve beside native vLLM-Omni on the one GPU) and
#          benchmarks/code2wav_cost.py --device cuda (the real-size code2wav); ~5 min. In a session without the
#          time for both, `bench` runs as call 4 of a later one (carrying .dev/c4: either phase extracts it).
#
# Usage (repository root): bash .gpu/run_gpu_checks.sh tests|bench
# Every step's output is tee'd into $OUT (the run tool brings it back, even from a run cut short).
set -uo pipefail
phase="${1:?usage: bash .gpu/run_gpu_checks.sh tests|bench}"
SITE="${SITE:-/tmp/site}"  # where calls 1-3 extracted c1-c3
OUT="${OUT:-/tmp/gpu-checks}"
mkdir -p "$OUT/logs"
started=$(date +%s)
say() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$OUT/steps.log"; }

# The kit's environment (its README): the carried site first, then this checkout; the sampler
# imports flashinfer on CUDA unless told not to, and flashinfer is not carried.
export PYTHONPATH="$SITE:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 OMNI_SERVE_CACHE=/tmp/omni_serve_cache
PY="${PY:-python3}"

if [ -f .dev/c4/c4.tar.xz ] && [ ! -f "$SITE/.c4-extracted" ]; then
  say "c4: check and extract"
  sha256sum -c .dev/c4/c4.sha256 || { say "c4: checksum mismatch"; exit 1; }
  $PY -c "import tarfile; tarfile.open('.dev/c4/c4.tar.xz').extractall('$SITE', filter='tar')" && touch "$SITE/.c4-extracted"
fi
# One part of each earlier call's archive (c1.top, c2.top, c3.top): calls 1-3 ran on this machine.
for part in vllm/_C_stable_libtorch.abi3.so vllm_omni ray; do
  [ -e "$SITE/$part" ] || { say "$SITE/$part missing: make the kit's calls 1-3 first (they extract c1-c3)"; exit 1; }
done

say "machine"
{ nvidia-smi; df -h /tmp; nproc; free -g; } > "$OUT/machine.txt" 2>&1
say "imports"
$PY - <<'PY' 2>&1 | tee "$OUT/imports.txt"
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "torchvision", "transformers", "vllm", "vllm_omni", "ray", "pydantic", "fastapi",
             "av", "soundfile", "httpx", "openai", "pytest", "diffusers", "psutil", "omni_serve"):
    try:
        module = importlib.import_module(name)
        print(f"{name:14s} {getattr(module, '__version__', '?'):24s} {getattr(module, '__file__', '')}")
    except Exception as err:  # keep going: the list shows every gap at once
        print(f"{name:14s} FAILED {type(err).__name__}: {err}")
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import ray.serve, vllm_omni.engine.stage_engine_startup  # noqa: F401,E401  - the engine path omni_serve calls
print("ray.serve and vLLM-Omni's stage startup import")
PY
say "tiny checkpoints"
for name in tiny-qwen3-omni tiny-qwen-image; do
  $PY -m omni_serve.checkpoints "$name" >> "$OUT/checkpoints.log" 2>&1 || say "checkpoint $name failed (see checkpoints.log)"
done

collect_ray_logs() {  # the replicas' and engines' own logs: where a stage's error is written
  local logs=/tmp/ray/session_latest/logs
  [ -d "$logs" ] || return 0
  mkdir -p "$OUT/ray"
  for f in "$logs"/serve/*.log "$logs"/worker-*.err; do
    [ -s "$f" ] && tail -n 300 "$f" > "$OUT/ray/$(basename "$f")"
  done
}

case "$phase" in
  tests)
    say "pytest: the one-GPU module (its CPU checks too)"
    timeout 330 $PY -m pytest -p no:cacheprovider -v -rs --durations=10 tests/test_vllm_omni_gpu.py 2>&1 \
      | tee "$OUT/pytest_vllm_omni_gpu.log"
    say "pytest exit ${PIPESTATUS[0]}"
    collect_ray_logs
    # Its gpu tests only: some of its CPU tests resolve Qwen/Qwen-Image on the hub, which this machine cannot reach.
    say "pytest: the vLLM-Omni diffusion graph on the same GPU"
    timeout 120 $PY -m pytest -p no:cacheprovider -v -rs -m gpu tests/test_vllm_omni_diffusion.py 2>&1 \
      | tee "$OUT/pytest_vllm_omni_diffusion.log"
    say "pytest exit ${PIPESTATUS[0]}"
    collect_ray_logs
    ;;
  bench)
    say "vs_vllm_omni --gpu"
    timeout 280 $PY benchmarks/vs_vllm_omni.py --gpu --out "$OUT/vs_vllm_omni_gpu.json" --logs "$OUT/logs" \
      2>&1 | tee "$OUT/vs_vllm_omni_gpu.log"
    say "vs_vllm_omni exit ${PIPESTATUS[0]}"
    collect_ray_logs
    say "code2wav_cost"
    timeout 40 $PY benchmarks/code2wav_cost.py --device cuda --repeats 20 2>&1 | tee "$OUT/code2wav_cost.log"
    say "code2wav_cost exit ${PIPESTATUS[0]}"
    ;;
  *) echo "unknown phase $phase (tests|bench)" >&2; exit 2 ;;
esac
say "done"
