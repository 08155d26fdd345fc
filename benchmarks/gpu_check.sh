#!/usr/bin/env bash
# One prepared check for a GPU host: the CUDA tests and `tierkv bench`, results under $OUT.
# Installs nothing (uses .venv if present, else `python`), needs no network, finishes in < 5 minutes (timeouts 90 + 45 + 45 + 120 s), so a rerun fits the device time:
# each step has its own timeout and a failing step does not stop the next one.
#
#   OUT=/tmp/gpu-results bash benchmarks/gpu_check.sh
#
# Writes: env.txt (GPU, torch, disk engines), pytest-cuda.txt, links-cuda.txt, scale-cuda.txt, bench.txt,
# tierkv-profile.json,
# tierkv-bench.png, summary.txt (exit status of each step).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=python
[ -x .venv/bin/python ] && PY=.venv/bin/python
BENCH_DIR=${TIERKV_BENCH_DIR:-${TMPDIR:-/tmp}/tierkv-gpu-check}
mkdir -p "$BENCH_DIR"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: CUDA is not visible to torch (no GPU, or a CPU build of torch): nothing to check" | tee "$OUT/summary.txt"
  exit 2
fi

{
  date -Is
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  "$PY" -c "import tierkv.io as io; print('disk engines:', io.engine_status())"
  "$PY" -c "import tierkv.settings as s; print('settings:', s.describe())"
  df -hT "$BENCH_DIR"
  "$PY" -m pip list 2>/dev/null
} > "$OUT/env.txt" 2>&1

timeout 90 "$PY" -m pytest -m cuda tests -q -rs -p no:cacheprovider > "$OUT/pytest-cuda.txt" 2>&1
pytest_rc=$?

# pinned H2D / D2H against a plain torch copy of 256 MiB, side by side (target >= 0.9x)
timeout 45 "$PY" -m pytest -m cuda benchmarks/test_links.py --benchmark-enable -s -q -p no:cacheprovider \
  > "$OUT/links-cuda.txt" 2>&1
links_rc=$?

# the scale paths: one layer of 4,096 blocks from pinned host memory (kernel count, GB/s vs a plain copy)
timeout 45 "$PY" -m pytest -m cuda benchmarks/test_scale.py --benchmark-enable -s -q -p no:cacheprovider \
  > "$OUT/scale-cuda.txt" 2>&1
scale_rc=$?

# 512 MiB file, 3 repeats: about 2 minutes on an H100/H200 host.
timeout 120 "$PY" -m tierkv.cli bench --dir "$BENCH_DIR" --disk-size 512MiB --max-size 256MiB --repeats 3 \
  --profile-out "$OUT/tierkv-profile.json" --plot-out "$OUT/tierkv-bench.png" > "$OUT/bench.txt" 2>&1
bench_rc=$?
rm -rf "$BENCH_DIR"

printf 'pytest -m cuda: exit %s\nlink benchmarks (cuda): exit %s\nscale (cuda): exit %s\ntierkv bench: exit %s\n' \
  "$pytest_rc" "$links_rc" "$scale_rc" "$bench_rc" | tee "$OUT/summary.txt"
[ "$pytest_rc" -eq 0 ] && [ "$links_rc" -eq 0 ] && [ "$scale_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
