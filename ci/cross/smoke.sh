#!/usr/bin/env bash
# Load smoke test of cross-built provider wheels under user-mode emulation: unpack the wheels and
# the target's CUDA runtime wheel as pip lays them out (site/cake_rmsnorm_<tag>/lib/*.so beside
# site/nvidia/cu13/lib), then dlopen every library and call cake_info (ci/cross/smoke.c) under
# qemu-MACHINE with the target's glibc, libstdc++ and libgcc_s as sysroot.
#
# Usage: ci/cross/smoke.sh MACHINE ROOT WHEEL...     (ROOT: as prepared by ci/cross/setup.sh)
# Needs qemu-MACHINE and a sysroot in /usr/MACHINE-linux-gnu (or $CAKE_CROSS_SYSROOT); PyPI has
# neither, Debian has both: apt-get install qemu-user libc6-arm64-cross libstdc++6-arm64-cross.
# Exit: 0 every library loads, 1 one does not, 77 skipped (no emulator or sysroot here).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,10p' "$0" >&2; exit 2; }
machine=$1 root=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
sysroot=${CAKE_CROSS_SYSROOT:-/usr/$machine-linux-gnu}
qemu=$(command -v "qemu-$machine" || true)
if [ -z "$qemu" ] || [ ! -e "$sysroot/lib/libc.so.6" ] || [ ! -e "$sysroot/lib/libstdc++.so.6" ]; then
  echo "smoke: skipped: needs qemu-$machine and a $machine sysroot with libc and libstdc++ at $sysroot" \
       "(Debian: apt-get install qemu-user libc6-arm64-cross libstdc++6-arm64-cross; not on PyPI)"
  exit 77
fi
site=$(mktemp -d "${TMPDIR:-/tmp}/cake-smoke.XXXXXX")
trap 'rm -rf "$site"' EXIT
cp -r "$root/runtime/nvidia" "$site/nvidia"
python - "$site" "$@" <<'EOF'
import sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            zf.extract(info, sys.argv[1])
EOF
chmod -R u+rwX,go+rX "$site"
ZIG_GLOBAL_CACHE_DIR=$root/zig-cache ZIG_LOCAL_CACHE_DIR=$root/zig-cache \
  "$root/zig/ziglang/zig" cc -target "$machine-linux-gnu.2.17" -O2 -g0 \
  -I "$here/../../csrc/include" "$here/smoke.c" -o "$site/smoke"
libs=("$site"/cake_rmsnorm_*/lib/*.so)
[ -e "${libs[0]}" ] || { echo "smoke: no provider libraries in $*" >&2; exit 1; }
"$qemu" -L "$sysroot" "$site/smoke" "${libs[@]}" | sed "s|$site/||"
echo "smoke: ${#libs[@]} $machine libraries load under $qemu (sysroot $sysroot)"
