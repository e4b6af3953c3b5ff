#!/usr/bin/env bash
# Install test of a wheelhouse, as a user would meet it: a fresh venv, nothing but the wheelhouse.
#
#   ci/install_test.sh WHEELHOUSE ARCH_TAG [--width W,..] [--python PYTHON]
#
#   pip install --no-index --find-links WHEELHOUSE 'cake-rmsnorm[ARCH_TAG]'
# then checks pip chose cake-rmsnorm-ARCH_TAG at the shim's version (and for this machine, and no
# other provider), imports both packages outside the checkout, runs `cake-rmsnorm verify installed`
# (cuobjdump from the wheelhouse) and `cake-rmsnorm doctor`. --width: the wheels hold a reduced plan
# (CI's quick cells), so verify against those widths. No GPU needed; doctor says there is none.
set -euo pipefail
usage() { sed -n '2,10p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
house=$(cd "$1" && pwd) tag=$2; shift 2
width="" python=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --width) width=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    *) usage ;;
  esac
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cake-install-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"  # never import from the checkout
unset PYTHONPATH CAKE_NVCC CAKE_CUOBJDUMP VIRTUAL_ENV
"$python" -m venv venv
pip() { venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# Not cake-rmsnorm-native, where the wheelhouse has it: it requires exactly one torch release,
# which the wheelhouse does not carry (a user installs it only where that torch already is).
pip install --no-index --find-links "$house" --report report.json "cake-rmsnorm[$tag]"

# What pip chose: the shim and this arch's provider at one version, a wheel for this machine.
venv/bin/python - "$tag" "$(uname -m)" <<'EOF'
import json, sys
tag, machine = sys.argv[1], sys.argv[2]
report = json.load(open("report.json"))
chosen = {i["metadata"]["name"].lower().replace("_", "-"): i for i in report["install"]}
shim, want = chosen.get("cake-rmsnorm"), f"cake-rmsnorm-{tag}"
provider = chosen.get(want)
others = sorted(n for n in chosen if n.startswith("cake-rmsnorm-") and n != want)
problems = []
if shim is None or provider is None:
    problems.append(f"pip did not install both cake-rmsnorm and {want}: {sorted(chosen)}")
else:
    if provider["metadata"]["version"] != shim["metadata"]["version"]:
        problems.append(f"{want} {provider['metadata']['version']} beside cake-rmsnorm "
                        f"{shim['metadata']['version']}")
    url = provider["download_info"]["url"]
    if not url.endswith(f"_{machine}.whl"):
        problems.append(f"{want} came from {url}, not a {machine} wheel")
if others:
    problems.append(f"other providers installed too: {others}")
if problems:
    sys.exit("install test: " + "; ".join(problems))
print(f"install test: pip chose {provider['download_info']['url'].rsplit('/', 1)[-1]} "
      f"for cake-rmsnorm[{tag}] {shim['metadata']['version']}")
EOF

venv/bin/python -c "
import importlib.metadata as md, cake_rmsnorm, cake_rmsnorm_$tag as p
assert p.__version__ == cake_rmsnorm.__version__ == md.version('cake-rmsnorm'), (p.__version__, cake_rmsnorm.__version__)
print('import: cake_rmsnorm', cake_rmsnorm.__version__, 'and cake_rmsnorm_$tag', p.ARCH, 'from', p.__file__)"

# verify installed reads SASS with cuobjdump: the wheelhouse carries it (ci/wheelhouse.py deps).
pip install --no-index --find-links "$house" nvidia-cuda-cuobjdump
if [ -z "$width" ]; then
  venv/bin/cake-rmsnorm verify installed
else
  venv/bin/python - "$width" <<'EOF'
import sys
from cake_rmsnorm.build.verify import verify_installed
widths = [int(w) for w in sys.argv[1].split(",")]
problems = verify_installed(widths)
if problems:
    sys.exit(f"verify installed: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))
print(f"verify installed: OK (widths {widths})")
EOF
fi
venv/bin/cake-rmsnorm doctor
echo "install test: OK ($tag from $house)"
