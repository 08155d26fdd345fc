#!/usr/bin/env bash
# A separate virtual environment for kvpress (it pins transformers<5.3; tierkv's own venv has a newer one).
# Usage: bash benchmarks/quality/kvpress_env.sh [VENV_DIR]   (default /tmp/tierkv-kvpress-venv)
# Then:  VENV_DIR/bin/python benchmarks/quality/kvpress_run.py --help
set -euo pipefail
venv="${1:-/tmp/tierkv-kvpress-venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q "kvpress==0.5.5" "transformers<5.3" gguf
"$venv/bin/python" -c "import kvpress, transformers, torch; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__, 'torch', torch.__version__)"
