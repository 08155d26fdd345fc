#!/usr/bin/env bash
# The one prepared check for a GPU host (docs/gpu-check.md): everything it finds goes under $OUT.
#
#   OUT=/tmp/gpu-results bash benchmarks/gpu_check.sh
#
# Exit 2 (and nothing else run) unless torch sees CUDA; 1 if any step failed; 0 if all passed.
# Installs nothing from the network: kvikio is installed only from wheels carried in ./wheels (see
# docs/gpu-check.md for the one-line download), into a private folder under $TMPDIR. Uses .venv if present.
# Each step has its own timeout and a failing step does not stop the next; the timeouts add up to 570 s; the
# steps took 180 s on an H200 (docs/benchmarks.md).
#
# Writes: env.txt (date, GPU, driver, CUDA, torch, pip list, disk engines, settings), build.txt, kvikio-install.txt,
# pytest-cuda.txt, split-cuda.txt, split-profile.txt, links-cuda.txt, scale-cuda.txt, decode-cuda.txt,
# offloaded-cuda.txt, bench.txt,
# tierkv-profile.json, tierkv-bench.png, summary.txt (exit status and seconds of each step).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=python3  # GPU images name their torch-holding interpreter python3 (and may have no plain python)
[ -x .venv/bin/python ] && PY=.venv/bin/python
SCRATCH=${TMPDIR:-/tmp}/tierkv-gpu-check
rm -rf "$SCRATCH"
mkdir -p "$SCRATCH/bench"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" > "$OUT/cuda-probe.txt" 2>&1; then
  echo "gpu_check: CUDA is not visible to torch (no GPU, or a CPU build of torch): nothing checked" \
    | tee -a "$OUT/cuda-probe.txt" "$OUT/summary.txt" >&2
  exit 2
fi

: > "$OUT/summary.txt"
failed=0
step() {  # step NAME TIMEOUT OUTFILE COMMAND...: run with a timeout, record status and seconds
  local name=$1 limit=$2 out=$3
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$out" 2>&1
  local rc=$?
  [ "$rc" -eq 124 ] && echo "gpu_check: $name timed out after $limit s" >> "$OUT/$out"
  printf '%-22s exit %3s  %4s s (limit %s s)  %s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" "$out" \
    | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || failed=1
}

# kvikio: the image has cupy and cuFile but no kvikio; install carried wheels, offline, into a private folder
if compgen -G "wheels/*kvikio*.whl" > /dev/null; then
  step kvikio-install 30 kvikio-install.txt \
    "$PY" -m pip install --no-index --no-deps --target "$SCRATCH/site" wheels/*.whl
  export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no wheels/*kvikio*.whl carried: kvikio is checked only if the image has it" > "$OUT/kvikio-install.txt"
fi

step env 30 env.txt bash -c '
  date -Is; uname -a; echo
  nvidia-smi
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$0" -c "import sys, torch; print(\"python\", sys.version.split()[0]); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version(), torch.cuda.get_device_name())"
  "$0" -c "import transformers; print(\"transformers\", transformers.__version__)"
  "$0" -c "import tierkv.io as io; print(\"disk engines:\", io.engine_status())"
  "$0" -c "import tierkv.settings as s; print(\"settings:\", s.describe())"
  df -hT "'"$SCRATCH"'"
  "$0" -m pip list 2>/dev/null' "$PY"

# the native disk engine and attention kernels, built in place once (else each would build on first use inside
# a timed step)
step build 60 build.txt "$PY" setup.py -q build_ext --inplace --parallel 16

PYTEST=("$PY" -m pytest -m cuda -q -rs -p no:cacheprovider)
# the cuda tests: generation on the GPU within the budget, streaming, kvikio reads into CUDA tensors, its mode,
# and the disk tier reading into device memory with GDS (tests/test_disk_device_reads.py; skips in compat mode)
step pytest-cuda 60 pytest-cuda.txt "${PYTEST[@]}" tests --ignore=tests/test_split_cuda.py
# the split executor's CUDA path: the device share on the GPU, the host and disk shares on the CPU, merged;
# tokens and logits against DynamicCache, then one decode step's time beside exact gather's, printed
step split 90 split-cuda.txt "${PYTEST[@]}" -s tests/test_split_cuda.py --basetemp "$SCRATCH/split"
# where split's step goes beside gather's: cProfile and torch's profiler over the split step's scene
step split-profile 60 split-profile.txt env PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/split_cuda_profile.py
# pinned H2D / D2H: the store's own copies vs a plain pinned copy of the same 256 MiB, targets asserted
step links 30 links-cuda.txt "${PYTEST[@]}" -s benchmarks/test_links.py -k targets
# one layer of 4,096 blocks from pinned host memory: kernel count, GB/s vs a plain copy
step scale 30 scale-cuda.txt "${PYTEST[@]}" -s benchmarks/test_scale.py
# exact (bf16) and streaming (fp32) decode on Llama-3.1-8B's attention shape, most KV on host and disk
step decode 60 decode-cuda.txt "${PYTEST[@]}" -s benchmarks/test_gpu_decode.py --basetemp "$SCRATCH/decode"
# tierkv beside transformers' own offloaded caches (DynamicCache / StaticCache with offloading=True) on the same
# shape, 8 layers, 8K and 32K tokens: device memory, step time, same tokens
step offloaded 75 offloaded-cuda.txt "${PYTEST[@]}" -s benchmarks/test_gpu_offloaded.py --basetemp "$SCRATCH/offloaded"
# the link profile: 256 MiB file, 2 repeats (every engine that loads, kvikio too when carried)
step bench 45 bench.txt "$PY" -m tierkv.cli bench --dir "$SCRATCH/bench" --disk-size 256MiB --max-size 128MiB \
  --repeats 2 --profile-out "$OUT/tierkv-profile.json" --plot-out "$OUT/tierkv-bench.png"

rm -rf "$SCRATCH"
[ "$failed" -eq 0 ] && echo "gpu_check: all steps passed" | tee -a "$OUT/summary.txt"
exit "$failed"
