#!/usr/bin/env bash
# On a GPU machine with the wheels installed: the out-of-bounds canary over every library of this
# GPU's arch at T 1, 3, 1025, then the same under each compute-sanitizer tool.
# Usage: ci/sanitize.sh [per-tool timeout seconds, default 150] [extra sanitize_programs.py args]
set -uo pipefail
cd "$(dirname "$0")/.."
limit=${1:-150}; shift || true
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
echo "== canary (no sanitizer)"
python3 ci/sanitize_programs.py "$@" | tail -3
status=${PIPESTATUS[0]}
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$sanitizer" ]; then
  echo "compute-sanitizer not found: canary results only"; exit $status
fi
for tool in memcheck racecheck initcheck synccheck; do
  echo "== compute-sanitizer --tool $tool"
  start=$(date +%s)
  timeout "$limit" "$sanitizer" --tool "$tool" --error-exitcode 1 python3 ci/sanitize_programs.py "$@" 2>&1 | tail -4
  rc=${PIPESTATUS[0]}
  echo "   $tool: exit $rc after $(( $(date +%s) - start )) s"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
