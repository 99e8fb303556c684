#!/usr/bin/env bash
# One prepared GPU check of the ragged paged attention kernels, end to end in under 5 minutes:
#   1. the kernel tests natively on the GPU (pytest --platform gpu -m gpu tests/pallas_kernels),
#   2. the attention benchmark (bench/attention_kernel.py --preset h200).
# Outputs (logs, junit XML, benchmark JSON) go to $OUT if set, else ./gpu_check_out.
# Usage, from anywhere:  bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

# jaxserve installs its four folders under one namespace; install it (offline, no deps) if the
# machine has not yet.
if ! "$python" -c "import jaxserve.pallas_kernels" 2>/dev/null; then
  "$python" -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
    || { echo "install failed, see $out/install.log"; exit 2; }
fi
"$python" - <<'PY' 2>&1 | tee "$out/devices.txt"
import jax
print("jax", jax.__version__, jax.devices())
assert jax.default_backend() == "gpu", "no GPU visible to jax"
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2

timeout 160 "$python" -m pytest --platform gpu -m gpu tests/pallas_kernels -q -rs \
  --junitxml="$out/pytest_gpu.xml" 2>&1 | tee "$out/pytest_gpu.txt"
tests_status=${PIPESTATUS[0]}

timeout 120 "$python" bench/attention_kernel.py --preset h200 \
  --out "$out/attention_kernel.json" 2>&1 | tee "$out/attention_kernel.txt"
bench_status=${PIPESTATUS[0]}

echo "pytest exit: $tests_status, benchmark exit: $bench_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
