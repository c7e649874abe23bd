# Issue 12: time tuning bundles on the H200 with the TVM runtime alone (luce_runtime.tune_bench), in one call.
#
# Here, first:  luce-compile tune MODEL --target sm_90 --bundle .gpucheck/tune/NAME [--extent batch=512] (per model)
#               and .gpucheck/h200/bundle (the runtime bundle: benchmarks/h200/prepare.py, or scripts/device_check.py
#               prepare --bundle)
# Device call, from the repository root, with carry [".gpucheck/tune", ".gpucheck/h200/bundle"]:
#               bash benchmarks/h200/tune.sh        (BUNDLES="a b" limits the set; PER_BUNDLE seconds each, 240)
# Then here:    luce-compile tune --ingest <files_at>/tune-*.json   (records the winners in autotune_logs/sm_90/)
set -o pipefail
W=/tmp/tune-work; OUT=${OUT:-/tmp/tune-out}; mkdir -p "$W/site" "$OUT"
if [ ! -d "$W/site/tvm" ]; then
  tar xzf .gpucheck/h200/bundle/tvm-runtime.tgz -C "$W/site" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" .gpucheck/h200/bundle/*.whl || exit 3
fi
export PYTHONPATH=$W/site:$PWD/runtime:$PWD PYTHONUNBUFFERED=1
BUNDLES=${BUNDLES:-$(cd .gpucheck/tune && ls -d */ | tr -d /)}
start=$(date +%s)
# the device's copy bandwidth in the same call: what a memory-bound kernel's time is a fraction of
python3 -c "import json, tvm; from luce_runtime.engine import load_device_api; load_device_api('cuda')
from luce_runtime.bench import device_bandwidth_gb_s
print(json.dumps({'device_copy_gb_s': device_bandwidth_gb_s(tvm.cuda(0))}))" > "$OUT/bandwidth.json" 2>> "$OUT/tune-log.txt"
for b in $BUNDLES; do
  # a re-run on a warm machine resumes: tune_bench skips what --out already holds
  timeout "${PER_BUNDLE:-240}" python3 -m luce_runtime.tune_bench ".gpucheck/tune/$b" --out "$OUT/tune-$b.json" \
    >> "$OUT/tune-log.txt" 2>&1
  echo "[$(( $(date +%s) - start ))s] $b rc=$?" | tee -a "$OUT/tune-log.txt"
done
