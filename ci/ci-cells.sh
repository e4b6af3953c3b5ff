#!/usr/bin/env bash
# CI's quick matrix (.ci/run, beside the tests): every arch's cell on this machine's host platform,
# plus one cross-built aarch64 cell, at a reduced width set: built, verified, packaged, assembled
# into a wheelhouse and install-tested from it in fresh venvs (ci/run-matrix.sh). Minutes, not the
# full matrix: the full width set is ci/run-matrix.sh's, or the workflow's.
#
#   CAKE_CI_CELLS_SELECT  identifier globs (default: 'sm*-manylinux_<this machine> sm103a-manylinux_aarch64':
#                         the providers; native-* cells download a torch wheel, and the tests
#                         already build the native step against the installed torch)
#   CAKE_CI_CELLS_WIDTH   widths (default 256)
#   CAKE_CI_CELLS_ROOT    trees, wheels and tools (default build/ci-cells; the wheelhouse goes inside)
set -euo pipefail
cd "$(dirname "$0")/.."
select=${CAKE_CI_CELLS_SELECT:-"sm*-manylinux_$(uname -m) sm103a-manylinux_aarch64"}
width=${CAKE_CI_CELLS_WIDTH:-256}
root=${CAKE_CI_CELLS_ROOT:-build/ci-cells}
bash ci/setup-venv.sh build
. .venv/bin/activate
exec bash ci/run-matrix.sh --select "$select" --width "$width" --root "$root" \
  --wheelhouse "$root/wheelhouse"
