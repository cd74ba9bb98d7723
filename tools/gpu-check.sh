#!/usr/bin/env bash
# The RL loop with vLLM and DeepSpeed on one NVIDIA GPU, in under 10 minutes: installs the
# official vLLM build and DeepSpeed (pinned) into an environment of their own (never .venv,
# whose torch is the CPU build), then runs tools/gpu_check.py: vLLM samples groups, DeepSpeed
# trains a policy-gradient step, the new weights are loaded into the running vLLM in place.
# Prints tokens/s and the weight-sync time per step, then one JSON line with the totals.
#
#   bash tools/gpu-check.sh [gpu_check.py arguments, e.g. --steps 8 --eager]
#
# GPU_CHECK_VENV: the environment (default ~/.cache/orchard/venv-gpu-check, reused by later
# runs); GPU_CHECK_TIMEOUT_S: limit of the loop itself (default 480); PYTHON: the interpreter that creates the environment (python3).
# Without a GPU it stops at once with status 1, before installing anything.
set -euo pipefail

VLLM_VERSION=0.32.0
DEEPSPEED_VERSION=0.19.8
PROTOBUF_SPEC="protobuf>=7.35.1,<8" # what the generated orchard.types code needs

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GPU_CHECK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/orchard/venv-gpu-check}"
limit="${GPU_CHECK_TIMEOUT_S:-480}"
smi="${NVIDIA_SMI:-nvidia-smi}"

fail() {
    echo "gpu-check: $*" >&2
    exit 1
}

if ! command -v "$smi" >/dev/null 2>&1; then
    fail "no NVIDIA GPU here ($smi not found): this check needs one CUDA GPU. On a CPU," \
        "'make vllm-cpu-env' and services/rollout/tests/engines/test_vllm_engine.py check vLLM."
fi
if ! gpus="$("$smi" --query-gpu=name,memory.total --format=csv,noheader 2>&1)"; then
    fail "$smi cannot reach a GPU (driver not loaded?): ${gpus:-no output}"
fi
if [ -z "$gpus" ]; then
    fail "$smi lists no GPU"
fi
echo "gpu-check: $(printf '%s\n' "$gpus" | head -n 1)"

started=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "vllm==$VLLM_VERSION" "$PROTOBUF_SPEC"
# DeepSpeed builds against the torch vLLM brought (its ops compile on first use, if ever).
"${pip[@]}" --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
echo "gpu-check: environment ready in $((SECONDS - started)) s ($venv)"

"$venv/bin/python" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: torch in the environment sees no CUDA device (driver/CUDA mismatch?)")
print("gpu-check: torch", torch.__version__, "on", torch.cuda.get_device_name(0))'

sources=(libs/proto/src libs/core/src libs/lm/src services/rollout/src services/trainer/src)
pythonpath="$(printf '%s:' "${sources[@]/#/$root/}")"
loop_started=$SECONDS
status=0
PYTHONPATH="${pythonpath%:}${PYTHONPATH:+:$PYTHONPATH}" VLLM_NO_USAGE_STATS=1 \
    timeout --kill-after=30 "$limit" "$venv/bin/python" "$root/tools/gpu_check.py" \
    --engine vllm "$@" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    fail "the RL loop did not finish within $limit s (GPU_CHECK_TIMEOUT_S)"
elif [ "$status" -ne 0 ]; then
    fail "the RL loop failed (status $status); its output is above"
fi
echo "gpu-check: OK, loop $((SECONDS - loop_started)) s, $((SECONDS - started)) s in all"
