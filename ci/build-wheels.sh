#!/usr/bin/env bash
# Fresh machine → verified wheels: set up .venv with the toolchain, build, package, verify.
# Usage: ci/build-wheels.sh [--arch sm_90a|A,B|all] [--out DIR] [-j N] [--native TORCH]
#        (default sm_90a, dist/; --native 2.11.0 also builds the native eager step's wheel for that
#        torch release, whose wheel it downloads for the headers: build/native.py)
set -euo pipefail
cd "$(dirname "$0")/.."
arch=sm_90a out=dist jobs=$(nproc) native=
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -j) jobs=$2; shift 2 ;;
    --native) native=$2; shift 2 ;;
    *) echo "usage: $0 [--arch ARCHS] [--out DIR] [-j N] [--native TORCH]" >&2; exit 2 ;;
  esac
done
bash ci/setup-venv.sh build
. .venv/bin/activate
cake-rmsnorm plan --arch "$arch" | tail -n 1
cake-rmsnorm build --arch "$arch" -j "$jobs"
cake-rmsnorm wheel --arch "$arch" --out "$out"
[ -z "$native" ] || python -m cake_rmsnorm.build.native --torch "$native" --out "$out"
cake-rmsnorm verify "$out"
