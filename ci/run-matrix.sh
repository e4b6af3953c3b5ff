#!/usr/bin/env bash
# Run the selected cells of the build matrix on this machine, then assemble the wheelhouse and run
# the install test of every cell this machine can run against it.
#
#   ci/run-matrix.sh [--select GLOB] [--width W,..] [-j N] [--root DIR] [--wheelhouse DIR]
#                    [--no-install-test]
#
#   --select      cell identifier globs (default: every cell; `cake-rmsnorm matrix` lists them)
#   --width       a reduced width set for every cell (default: all prebuilt widths)
#   --root        where trees, cell wheels, dependency wheels and cross tools go (default build/matrix)
#   --wheelhouse  the wheelhouse (default wheelhouse/)
#
# Cells of this machine's host platform build natively; cells that can be cross-built from it
# (ci/matrix.toml: cross_from) are cross-built; others are listed as needing their native runner
# and left out. Native cells (the native eager step's wheel per torch release) build on their own
# platform's machine only, go into the wheelhouse, and have no install test (it would pull torch).
# Cells run one after another (each compiles with -j N).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,17p' "$0" >&2; exit 2; }
select="*" width="" jobs=$(nproc) root=build/matrix house=wheelhouse install_test=1
while [ $# -gt 0 ]; do
  case "$1" in
    --select) select=$2; shift 2 ;;
    --width) width=$2; shift 2 ;;
    -j) jobs=$2; shift 2 ;;
    --root) root=$2; shift 2 ;;
    --wheelhouse) house=$2; shift 2 ;;
    --no-install-test) install_test=0; shift ;;
    *) echo "run-matrix: unknown argument $1" >&2; usage ;;
  esac
done
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
start=$(date +%s)
host=$(uname -m)

# Which cells run here: "identifier kind platform machine arch_tag mode" per line.
plan=$(cake-rmsnorm matrix --select "$select" --json | python -c "
import json, sys
host = sys.argv[1]
for c in json.load(sys.stdin)['include']:
    cross = host in c.get('cross_from', [])  # native cells have none
    mode = 'native' if c['machine'] == host else 'cross' if cross else 'runner:' + c['runner']
    print(c['identifier'], c['kind'], c['platform'], c['machine'], c.get('arch_tag', '-'), mode)" "$host")
built=() testable=() providers=0
while read -r id kind platform machine tag mode; do
  case "$mode" in
    runner:*) echo "== $id: needs a $machine host (CI runner ${mode#runner:}); left out"; continue ;;
  esac
  echo "== $id ($mode)"
  if [ "$kind" = native ]; then
    bash ci/run-cell.sh "$id" --out "$root/cells/$id" < /dev/null
  else
    bash ci/run-cell.sh "$id" ${width:+--width "$width"} -j "$jobs" --build-dir "$root/$platform" \
      --out "$root/cells/$id" --cross-root "$root/cross/$machine" --no-install-test < /dev/null
    providers=$((providers + 1))
    if [ "$mode" = native ]; then testable+=("$id:$tag"); fi
  fi
  built+=("$id")
done <<< "$plan"
[ ${#built[@]} -gt 0 ] || { echo "run-matrix: no cell of '$select' can run on this $host machine" >&2; exit 1; }
if [ "$providers" = 0 ]; then  # a wheelhouse needs the shim, which provider cells write
  echo "run-matrix: ${#built[@]} native cell(s), no provider cell: no wheelhouse; wheels in $root/cells"
  exit 0
fi

echo "== wheelhouse $house"
cells=()
for id in "${built[@]}"; do cells+=("$root/cells/$id"); done
# The wheels ours need ride along, so `pip install --no-index --find-links` resolves.
python ci/wheelhouse.py deps --out "$root/deps" --select "${built[*]}" >/dev/null
python ci/wheelhouse.py assemble --out "$house" --deps "$root/deps" "${cells[@]}"

if [ "$install_test" = 1 ]; then
  for item in "${testable[@]}"; do
    echo "== install test ${item%%:*} (fresh venv, --no-index from $house)"
    bash ci/install_test.sh "$house" "${item##*:}" ${width:+--width "$width"}
  done
fi
echo "run-matrix: ${#built[@]} cell(s) in $(( $(date +%s) - start )) s: ${built[*]}; wheelhouse $house"
