#!/usr/bin/env bash
# One call on the GPU machine: the stages named, in order, with their logs and results in $OUT.
#
#   bash benchmarks/device_pass.sh [--card H200] [check LIBDIR] [tune LIBDIR] [ab OLD NEW] [tests]
#                                  [bench] ...
#
#   (always)   install dist/*.whl and the peers' wheels in .whl/ into a scratch site (no network
#              there), print the card, `cake-rmsnorm verify installed`
#   check DIR  ci/check_programs.py over DIR (ci/program_libs.py's folder): every library against
#              the FP64 reference, det's bits, and the bits across program forms: $OUT/check.{log,json}
#   tune DIR   benchmarks/tune_routes.py over DIR (ci/program_libs.py's folder), keeping the
#              committed table's other windows: $OUT/tuned/{sm_90a.toml,tune.json}
#   ab OLD NEW benchmarks/ab_forward.py (its default H; its default T, or $AB_TOKENS, e.g.
#              128,1024,4096): two builds of the same forward programs, bits and times beside
#              torch.compile's: $OUT/ab.{log,json}
#   tests      pytest -m gpu tests/gpu: $OUT/pytest.txt
#   bench      the full benchmark, then benchmarks/acceptance.py over it: $OUT/bench.{json,md},
#              $OUT/plots.tgz, $OUT/acceptance.txt
#   --card S   stop before installing anything unless the card's name contains S (timings for a
#              note come from one card kind)
# Each stage runs under a time limit (CHECK_S, TUNE_S, AB_S, TESTS_S, BENCH_S seconds); a stage that
# fails or times out is reported and the next one still runs; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [ "${1:-}" = "--card" ]; then
    case "$card" in *"$2"*) ;; *) echo "not a $2: nothing run"; exit 3 ;; esac
    shift 2
fi
site=${SITE:-/tmp/cake-site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" dist/*.whl $(ls .whl/*.whl 2>/dev/null) || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m cake_rmsnorm verify installed 2>&1 | tail -3

status=0
stage() {  # stage NAME LIMIT_S LOG COMMAND...: run, time and report one stage
    local name=$1 limit=$2 log=$3 t0 rc
    shift 3
    t0=$(date +%s)
    timeout "$limit" "$@" > "$log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(( $(date +%s) - t0 )) s"
    tail -3 "$log"
    [ $rc -eq 0 ] || [ $status -ne 0 ] || status=$rc
}
while [ $# -gt 0 ]; do
    case "$1" in
        check)
            stage check "${CHECK_S:-300}" "$OUT/check.log" python3 ci/check_programs.py --libs "$2" \
                --json "$OUT/check.json"
            shift 2 ;;
        tune)
            stage tune "${TUNE_S:-420}" "$OUT/tune.log" python3 benchmarks/tune_routes.py --libs "$2" \
                --out "$OUT/tuned" --keep python/cake_rmsnorm/registry/data/tuned/sm_90a.toml
            shift 2 ;;
        ab)
            stage ab "${AB_S:-180}" "$OUT/ab.log" python3 benchmarks/ab_forward.py "$2" "$3" \
                ${AB_TOKENS:+--tokens "$AB_TOKENS"} --json "$OUT/ab.json"
            shift 3 ;;
        tests)
            stage tests "${TESTS_S:-240}" "$OUT/pytest.txt" \
                python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider
            shift ;;
        bench)
            stage bench "${BENCH_S:-360}" "$OUT/bench.log" \
                python3 benchmarks/bench_rmsnorm.py --out /tmp/cake-bench
            cp /tmp/cake-bench/bench.json /tmp/cake-bench/bench.md "$OUT/" 2>/dev/null
            tar czf "$OUT/plots.tgz" -C /tmp/cake-bench . 2>/dev/null
            stage acceptance 60 "$OUT/acceptance.txt" \
                python3 benchmarks/acceptance.py /tmp/cake-bench/bench.json
            grep FAIL "$OUT/acceptance.txt"
            shift ;;
        *)
            echo "unknown stage $1 (stages: check DIR, tune DIR, ab OLD NEW, tests, bench)"; exit 2 ;;
    esac
done
exit $status
