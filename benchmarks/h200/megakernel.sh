# Issue 11: the generated megakernels checked against the oracle and timed on the H200, runtime-only, one call.
#
# Here, first:  .venv/bin/python benchmarks/h200/prepare.py                 (once: .gpucheck/h200, the workloads)
#               .venv/bin/python scripts/megakernel_check.py prepare         (compiles .gpucheck/mk)
# Device call, from the repository root, with carry [".gpucheck/mk", ".gpucheck/h200/bundle"]:
#               bash benchmarks/h200/megakernel.sh        (MODELS="a b" limits the set, TIME=1 adds the timings,
#               MK_DIR=.gpucheck/mk-x runs a variant built there with prepare --dir; its results go to $OUT/<dir name>.json;
#               NO_ORACLE=1 skips the oracle check of models prepared with --no-reference, 7B and up;
#               CONTEXTS="512 8192 32768" times at those contexts (prepare --ctx at least the largest), LONG=N adds
#               the batched check with a first sequence of N tokens, for tiny models)
# Each model runs in its own process under a timeout (a kernel that deadlocks costs PER_MODEL seconds, not the
# call); the results gather in $OUT/mk.json after every model, the log in $OUT/log.txt.
set -o pipefail
W=/tmp/mk-work; OUT=${OUT:-/tmp/mk-out}; mkdir -p "$W/site" "$W/res" "$OUT"
BUNDLE=${BUNDLE:-.gpucheck/h200/bundle}  # the TVM runtime files (benchmarks/h200/prepare.py --dir D writes D/bundle)
if [ ! -d "$W/site/tvm" ]; then
  tar xzf $BUNDLE/tvm-runtime.tgz -C "$W/site" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" $BUNDLE/*.whl || exit 3
fi
export PYTHONPATH=$W/site:$PWD/runtime:$PWD PYTHONUNBUFFERED=1
MK_DIR=${MK_DIR:-.gpucheck/mk}; NAME=$(basename "$MK_DIR"); mkdir -p "$W/res/$NAME"
MODELS=${MODELS:-$(cd "$MK_DIR" && ls -d */ | tr -d /)}
start=$(date +%s)
for m in $MODELS; do
  timeout "${PER_MODEL:-180}" python3 scripts/megakernel_check.py run --dir "$MK_DIR" --models "$m" --out "$W/res/$NAME/$m.json" --work "$W" \
    ${TIME:+--time} ${NO_ORACLE:+--no-oracle} ${CONTEXTS:+--contexts $CONTEXTS} ${LONG:+--long $LONG} >> "$OUT/log.txt" 2>&1
  echo "[$(( $(date +%s) - start ))s] $m rc=$?" | tee -a "$OUT/log.txt"
  python3 -c "import json,glob,os; print(json.dumps({os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('$W/res/$NAME/*.json'))}, indent=1))" > "$OUT/$NAME.json"
done
