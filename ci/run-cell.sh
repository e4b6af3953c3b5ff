#!/usr/bin/env bash
# Run one cell of the build matrix (ci/matrix.toml): build, verify, wheel, install test.
#
#   ci/run-cell.sh IDENTIFIER [--width W,..] [-j N] [--build-dir DIR] [--out DIR] [--deps DIR]
#                  [--cross-root DIR] [--setup] [--install-toolkit] [--no-install-test]
#
#   IDENTIFIER      one cell, e.g. sm100a-manylinux_x86_64 or native-torch2.11.0-manylinux_x86_64
#                   (`cake-rmsnorm matrix --print-build-identifiers` lists them)
#   --width         a reduced width set (CI's quick cells): packaged and tested for those widths only
#   --build-dir     the build tree (default build/matrix/<platform id>: one per host platform)
#   --out           where the cell's wheels go (default build/matrix/cells/<identifier>)
#   --deps          dependency wheels for the install test (default build/matrix/deps/<platform id>;
#                   pip-downloaded when missing)
#   --cross-root    the cross tools of a cross-built cell (default build/matrix/cross/<machine>)
#   --setup         create/refresh .venv first (ci/setup-venv.sh build); CI passes it
#   --install-toolkit  pip install the matrix's toolkit pins first (CI); else only check nvcc's version
#   --no-install-test  stop after the wheels
#
# A cell whose host platform is this machine builds natively and runs the install test
# (ci/install_test.sh: a fresh venv from a wheelhouse of this cell). One whose platform lists this
# machine in cross_from is cross-built (ci/cross/: zig as nvcc's host compiler, the target's CUDA
# runtime from PyPI), its libraries checked (ELF machine, glibc versions) and load-tested under
# qemu where available (ci/cross/smoke.sh); otherwise the cell needs a native runner.
# A native cell (native-torch<T>-<platform id>) builds the native eager step's wheel for torch T
# (python -m cake_rmsnorm.build.native) and checks it (ci/wheelhouse.py check), on its platform's
# own machine only. It needs no CUDA toolkit (--install-toolkit is ignored; CI installs the package
# alone instead of --setup's toolchain) and takes only --out.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,27p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
id=$1; shift
width="" jobs=$(nproc) build_dir="" out="" deps="" cross_root="" setup=0 install_toolkit=0 install_test=1
while [ $# -gt 0 ]; do
  case "$1" in
    --width) width=$2; shift 2 ;;
    -j) jobs=$2; shift 2 ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --deps) deps=$2; shift 2 ;;
    --cross-root) cross_root=$2; shift 2 ;;
    --setup) setup=1; shift ;;
    --install-toolkit) install_toolkit=1; shift ;;
    --no-install-test) install_test=0; shift ;;
    *) echo "run-cell: unknown argument $1" >&2; usage ;;
  esac
done
case "$id" in *[\*\?\[,\ ]*) echo "run-cell: $id: one identifier, not a selector" >&2; exit 2 ;; esac
start=$(date +%s)
say() { echo "[$id $(( $(date +%s) - start ))s] $*"; }

if [ "$setup" = 1 ]; then bash ci/setup-venv.sh build; fi
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
command -v cake-rmsnorm >/dev/null || { echo "run-cell: no cake-rmsnorm here: run with --setup" >&2; exit 2; }

# The cell, from the matrix (the identifier must name exactly one cell): each field as cell_<key>.
cell=$(cake-rmsnorm matrix --select "$id" --json)
eval "$(python - "$id" "$cell" <<'EOF'
import json, shlex, sys
ident, doc = sys.argv[1], json.loads(sys.argv[2])
cells = [c for c in doc["include"] if c["identifier"] == ident]
if len(cells) != 1:
    sys.exit(f"run-cell: {ident} is not a cell identifier")
for key, value in cells[0].items():
    print(f"cell_{key}={shlex.quote(' '.join(value) if isinstance(value, list) else value)}")
EOF
)"
build_dir=${build_dir:-build/matrix/$cell_platform}
out=${out:-build/matrix/cells/$id}
deps=${deps:-build/matrix/deps/$cell_platform}
host=$(uname -m)

if [ "$cell_kind" = native ]; then
  # build/native.py downloads this machine's torch wheel and compiles with this host's g++.
  if [ "$host" != "$cell_machine" ]; then
    echo "run-cell: $id needs a $cell_machine host (CI runner $cell_runner); this is $host" >&2
    exit 1
  fi
  say "native eager step for torch $cell_torch -> $out (tag: $cell_wheel_tag, its glibc raised to what the library needs)"
  mkdir -p "$out"
  rm -f "$out"/*.whl
  CAKE_RMSNORM_WHEEL_PLATFORM=$cell_wheel_tag \
    python -m cake_rmsnorm.build.native --torch "$cell_torch" --out "$out"
  # Its ELF machine, glibc and size; the release job's assemble checks it against the other wheels.
  python ci/wheelhouse.py check "$out"
  say "OK: $(cd "$out" && ls *.whl | tr '\n' ' ')"
  exit 0
fi

# Toolkit: the cell's nvcc, exactly.
if [ "$install_toolkit" = 1 ]; then
  say "installing toolkit: $cell_toolkit_requirements"
  # shellcheck disable=SC2086
  python -m pip install -q --disable-pip-version-check $cell_toolkit_requirements
fi
real_nvcc=$(python -c "from cake_rmsnorm.build.toolchain import find_nvcc; print(find_nvcc() or '')")
have=$(python -c "import sys; from pathlib import Path; from cake_rmsnorm.build.toolchain import nvcc_version; print(nvcc_version(Path(sys.argv[1])) or '')" "$real_nvcc" 2>/dev/null || true)
if [ "$have" != "$cell_nvcc" ]; then
  echo "run-cell: $id is built with nvcc $cell_nvcc; this environment has '${have:-none}' ($real_nvcc);" \
       "fix: pip install $cell_toolkit_requirements   (or run with --install-toolkit)" >&2
  exit 1
fi

# Native, cross, or not here.
if [ "$host" = "$cell_machine" ]; then
  mode=native
elif [[ " $cell_cross_from " == *" $host "* ]]; then
  mode=cross
  cross_root=${cross_root:-build/matrix/cross/$cell_machine}
  say "cross build for $cell_machine from $host ($cell_cross_compiler)"
  CAKE_NVCC=$(bash ci/cross/setup.sh "$cell_machine" "$cross_root" "$cell_cross_compiler" \
              "$cell_runtime" "$real_nvcc")
  export CAKE_NVCC
else
  echo "run-cell: $id needs a $cell_machine host (CI runner $cell_runner)${cell_cross_from:+ or one of: $cell_cross_from}; this is $host" >&2
  exit 1
fi
export CAKE_RMSNORM_WHEEL_PLATFORM=$cell_wheel_tag

say "build $cell_arch ($mode, nvcc $cell_nvcc${width:+, widths $width}) into $build_dir"
cake-rmsnorm build --arch "$cell_arch" ${width:+--width "$width"} -j "$jobs" --build-dir "$build_dir"
say "verify build tree"
cake-rmsnorm verify "$build_dir/$cell_arch"

say "wheels -> $out ($cell_wheel_tag)"
mkdir -p "$out"
rm -f "$out"/*.whl
if [ -z "$width" ]; then
  cake-rmsnorm wheel --arch "$cell_arch" --out "$out" --build-dir "$build_dir"
  cake-rmsnorm verify "$out"
else  # a reduced plan: package and verify against those widths (the CLI packages full plans only)
  python - "$cell_arch" "$out" "$build_dir" "$width" <<'EOF'
import sys
from cake_rmsnorm.build.verify import verify_path
from cake_rmsnorm.build.wheel import write_wheels
arch, out, build_dir, widths = sys.argv[1], sys.argv[2], sys.argv[3], [int(w) for w in sys.argv[4].split(",")]
for path in write_wheels([arch], out, build_dir, widths=widths):
    print(f"{path}  {path.stat().st_size} bytes")
problems = verify_path(out, widths=widths)
if problems:
    sys.exit(f"verify {out}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))
print(f"verify {out}: OK (widths {widths})")
EOF
fi

# The cell's own wheelhouse check (ELF machine and glibc of every library, sizes), then its test.
house=$(mktemp -d "${TMPDIR:-/tmp}/cake-cell-house.XXXXXX")
trap 'rm -rf "$house"' EXIT
if [ "$mode" = native ] && [ "$install_test" = 1 ]; then
  if ! ls "$deps"/*.whl >/dev/null 2>&1; then
    say "downloading dependency wheels -> $deps"
    python ci/wheelhouse.py deps --out "$deps" --select "$id" >/dev/null
  fi
  python ci/wheelhouse.py assemble --out "$house/wheelhouse" --deps "$deps" "$out"
  say "install test"
  bash ci/install_test.sh "$house/wheelhouse" "$cell_arch_tag" ${width:+--width "$width"}
else
  python ci/wheelhouse.py assemble --out "$house/wheelhouse" "$out"
  if [ "$mode" = cross ]; then
    rc=0
    bash ci/cross/smoke.sh "$cell_machine" "$cross_root" "$out"/cake_rmsnorm_"$cell_arch_tag"-*.whl || rc=$?
    case $rc in
      0) ;;
      77) say "install test: needs a $cell_machine host (CI runner $cell_runner)" ;;
      *) exit "$rc" ;;
    esac
  fi
fi
say "OK: $(cd "$out" && ls *.whl | tr '\n' ' ')"
