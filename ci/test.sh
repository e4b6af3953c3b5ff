#!/usr/bin/env bash
# Fresh machine → the test suite: set up .venv (toolchain, pytest, a CPU torch), run pytest.
# GPU tests are marked `gpu` and skip cleanly without a GPU; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup-venv.sh build,test
. .venv/bin/activate
# torch is the op's runtime dependency; pin the CPU build this machine kind carries.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" numpy
python -m pytest -q "$@"
