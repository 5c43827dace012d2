#!/usr/bin/env bash
# Installs k3mono and everything its tests need on a fresh machine.
# Where no torch is importable, the CPU build is taken (torch==2.13.0 lies on
# the machines' disk); where one is (a GPU machine's torch 2.11), it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet torch==2.13.0
fi
"$PYTHON" -m pip install --quiet -e ".[test]"
