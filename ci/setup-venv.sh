#!/usr/bin/env bash
# Create (or reuse) .venv and install the project with the extras named in $1 (default: build).
# Everything comes from PyPI: the CUDA toolchain (nvcc >= 13.4), cmake and ninja included.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-build}
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[${extras}]"
