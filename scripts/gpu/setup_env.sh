# Sourced first by the device-call scripts (the GPU machine has no network): install the carried
# cp312 wheels (.whl/, from ../shared/tools/device-wheels.sh) into /tmp/site and put them and the
# repository on PYTHONPATH; unbuffered logs; a Triton cache that lives as long as the machine.
# Scripts that stamp a commit (ablation.py) read `git rev-parse HEAD` of the device copy, whose git
# metadata can lag the carried working tree (run66/run67 named b69f063 for 2aace4a's tree): pass
# FULLSTACK_COMMIT=<rev> on the call's command line.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc

# run NAME LIMIT CMD...: one step of a device call — CMD under `timeout LIMIT`, its output (less
# Python's and torch's warning lines) kept as $OUT/NAME.txt and its last ${TAILN:-40} lines shown.
# Only the warning lines go: a case-blind "warn" also dropped pytest's "N passed, M warnings" (run66).
run() { name=$1; limit=$2; shift 2; echo "===== $name ($(date +%T))"
        timeout "$limit" "$@" 2>&1 | grep -v -E 'Warning:|warnings\.warn\(' | tee "$OUT/$name.txt" \
          | tail -${TAILN:-40}; }

# keep_ablation DIR: scripts/ablation.py's table, JSON, plot and each arm's metrics.jsonl into $OUT.
keep_ablation() { cp "$1"/ablation.md "$1"/ablation.json "$1"/*.png "$OUT"/ 2>/dev/null
  for d in "$1"/*/; do a=$(basename "$d")
    [ -f "$d/metrics.jsonl" ] && mkdir -p "$OUT/$a" && cp "$d/metrics.jsonl" "$OUT/$a/"; done; return 0; }

# gpu_pytest NAME LIMIT PYTEST_ARGS...: pytest under `run`, ending *before* LIMIT with its summary
# and tracebacks: a run cut by `timeout` prints neither (run71, run72 lost them). The image's
# pytest-timeout (2.5.0) stops the session between tests after 3/5 of LIMIT (--session-timeout;
# with xdist too, checked here: it still prints the FAILURES section and the summary) and any
# one test after LIMIT/4 (--timeout; PER_TEST=S overrides it: a test that compiles many Triton
# kernels on a cold cache needs ~130 s alone, more beside 11 other workers, run77), so the run
# ends by ~0.85 LIMIT.
gpu_pytest() { name=$1; limit=$2; shift 2
  run "$name" "$limit" python3 -m pytest -p no:cacheprovider --tb=short -rfE \
    --timeout ${PER_TEST:-$((limit / 4))} --session-timeout $((limit * 3 / 5)) "$@"; }

# start_ablations ARMS NAME LOGDIR SEED...: scripts/ablation.py's arms ARMS (comma-separated, all
# at once) at each SEED, §I.1's setup (8 × 512, 300 steps, data/quickstart), in the background
# under `timeout 480`: results in /tmp/NAME_<seed>, logs in LOGDIR/abl_seed<seed>.txt. The
# caller waits.
start_ablations() { arms=$1; name=$2; logdir=$3; shift 3
  for sd in "$@"; do
    timeout 480 python3 scripts/ablation.py --iters 300 --ppl-tokens 65536 --cloze-items 200 \
      --time-budget 420 --arms "$arms" --jobs "$(echo "$arms" | tr , '\n' | wc -l)" \
      --out "/tmp/${name}_$sd" --set "train.seed=$sd" >"$logdir/abl_seed$sd.txt" 2>&1 &
  done; }
