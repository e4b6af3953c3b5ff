#!/usr/bin/env bash
# Prepare a cross build of the libraries' host part for MACHINE (aarch64) on another host (x86_64),
# everything from PyPI. Device code (SASS) is host-independent; only the host side changes: the
# launch stubs nvcc generates and the C ABI, compiled for the target and linked against its libraries.
#
#   ROOT/zig/       the cross host compiler: the `ziglang` wheel (clang, glibc headers, libc stubs)
#   ROOT/runtime/   the target's nvidia-cuda-runtime wheel, unpacked (its libcudart.so.13)
#   ROOT/stubs/     link-time stand-ins for the target's libstdc++.so.6 and libgcc_s.so.1
#                   (sources: ci/cross/stubs/), so NEEDED and symbol versions match a native build
#   ROOT/bin/c++    nvcc's -ccbin: zig c++ for MACHINE-linux-gnu
#   ROOT/bin/nvcc   what CAKE_NVCC points at: the real nvcc with -ccbin and the target's libraries
#
# Usage: ci/cross/setup.sh MACHINE ROOT COMPILER_PIN RUNTIME_PIN NVCC     (idempotent; quiet rerun)
#   e.g. ci/cross/setup.sh aarch64 build/matrix/cross/aarch64 ziglang==0.17.1 \
#            nvidia-cuda-runtime==13.5.37 "$(command -v nvcc)"
set -euo pipefail
[ $# -eq 5 ] || { sed -n '2,15p' "$0" >&2; exit 2; }
machine=$1 root=$2 compiler=$3 runtime=$4 nvcc=$5
here=$(cd "$(dirname "$0")" && pwd)
case "$machine" in
  aarch64) ;;
  *) echo "ci/cross/setup.sh: MACHINE $machine: only aarch64 is prepared here" >&2; exit 2 ;;
esac
[ -x "$nvcc" ] || { echo "ci/cross/setup.sh: NVCC $nvcc is not an executable" >&2; exit 2; }
mkdir -p "$root"
root=$(cd "$root" && pwd)
python=${PYTHON:-python}

# The compiler: pip --target (not into the build venv), redone only when the pin changes.
if [ "$(cat "$root/zig/.pin" 2>/dev/null)" != "$compiler" ]; then
  rm -rf "$root/zig"
  "$python" -m pip install -q --disable-pip-version-check --target "$root/zig" "$compiler"
  echo "$compiler" > "$root/zig/.pin"
fi
zig=$root/zig/ziglang/zig
[ -x "$zig" ] || { echo "ci/cross/setup.sh: $compiler has no $zig" >&2; exit 1; }

# The target's CUDA runtime: pip does not widen --platform, so name manylinux2014 (its wheel's tag).
if [ "$(cat "$root/runtime/.pin" 2>/dev/null)" != "$runtime" ]; then
  rm -rf "$root/runtime" "$root/download"
  "$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform "manylinux2014_$machine" --platform "manylinux_2_17_$machine" \
    -d "$root/download" "$runtime"
  "$python" - "$root/download" "$root/runtime" <<'EOF'
import sys, zipfile, pathlib
wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
assert len(wheels) == 1, f"expected one runtime wheel, got {wheels}"
zipfile.ZipFile(wheels[0]).extractall(sys.argv[2])
EOF
  echo "$runtime" > "$root/runtime/.pin"
fi
cudart_dir=$root/runtime/nvidia/cu13/lib
[ -f "$cudart_dir/libcudart.so.13" ] || { echo "ci/cross/setup.sh: no $cudart_dir/libcudart.so.13 in $runtime" >&2; exit 1; }

# glibc headers: zig ships one (newest) set of glibc headers and sets __GLIBC_MINOR__ from the
# target. CUDA 13.5's crt/math_functions.h decides by __GLIBC_PREREQ(2,41)/(2,42) whether glibc
# declares sinpi/cospi/rsqrt; with an older target version its declarations clash with those
# headers ("exception specification is incompatible"). So compile against the newest glibc zig
# knows: the libraries use only old symbols (GLIBC_2.17 on aarch64; ci/wheelhouse.py checks the
# highest version each library needs against the wheel's manylinux tag).
export ZIG_GLOBAL_CACHE_DIR=$root/zig-cache ZIG_LOCAL_CACHE_DIR=$root/zig-cache
"$zig" targets > "$root/zig-targets.zon"  # whole, to a file: zig fails on a closed pipe
glibc=$(awk '/\.glibc = \.\{/{f=1;next} f&&/\}/{exit} f' "$root/zig-targets.zon" | tr -d ' ",' \
        | sort -t. -k1,1n -k2,2n -k3,3n | tail -n 1 | cut -d. -f1,2)
[ -n "$glibc" ] || { echo "ci/cross/setup.sh: cannot read zig's glibc versions" >&2; exit 1; }
target=$machine-linux-gnu.$glibc

# Stubs: built for the oldest glibc of the machine (they are only linked against, never run).
mkdir -p "$root/stubs" "$root/bin"
build_stub() {  # source map soname
  "$zig" cc -target "$machine-linux-gnu.2.17" -shared -nostdlib -g0 \
    -Wl,--version-script="$here/stubs/$2" -Wl,-soname,"$3" "$here/stubs/$1" -o "$root/stubs/$3.tmp"
  mv "$root/stubs/$3.tmp" "$root/stubs/$3"
}
build_stub libstdcxx.c libstdcxx.map libstdc++.so.6
build_stub libgcc_s.c libgcc_s.map libgcc_s.so.1

write_if_changed() {  # path (text on stdin)
  local tmp=$1.tmp
  cat > "$tmp"; chmod 0755 "$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; fi
}
write_if_changed "$root/bin/c++" <<EOF
#!/bin/sh
# Written by ci/cross/setup.sh: zig's clang as nvcc's host compiler for $target.
# Compiling sees libc++ headers; linking takes no libc++ (-nostdlib++): the target's libstdc++.so.6
# and libgcc_s.so.1 (stubs at link time) serve the few C++ ABI symbols, as in a native build.
# -L dirs that do not exist (nvcc.profile's lib/stubs) are dropped: zig's linker warns of each.
link=-nostdlib++
for a in "\$@"; do
  shift
  case "\$a" in -c|-E|-M|-MM) link= ;; -L*) [ -d "\${a#-L}" ] || continue ;; esac
  set -- "\$@" "\$a"
done
ZIG_GLOBAL_CACHE_DIR='$root/zig-cache' ZIG_LOCAL_CACHE_DIR='$root/zig-cache' \\
  exec '$zig' c++ -target $target -g0 \$link "\$@"
EOF
write_if_changed "$root/bin/nvcc" <<EOF
#!/bin/sh
# Written by ci/cross/setup.sh: nvcc compiling the host part for $machine (CAKE_NVCC points here).
# The target's libcudart and stubs come before the -L dirs nvcc_step and nvcc.profile add (those
# hold the build host's libcudart); -z defs: every symbol must resolve against the target's libraries.
case " \$* " in *" --version "*|*" --list-gpu-arch "*) exec '$nvcc' "\$@" ;; esac
exec '$nvcc' -ccbin '$root/bin/c++' -L'$cudart_dir' -L'$root/stubs' "\$@" \\
  -l:libstdc++.so.6 -l:libgcc_s.so.1 -Xlinker -z -Xlinker defs
EOF
echo "$root/bin/nvcc"
