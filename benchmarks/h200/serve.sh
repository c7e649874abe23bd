# Serving on the H200 (issue 15): `luce-compile serve` with the runtime alone against llama.cpp's `llama-server -np N`
# (CUDA build, every layer on the GPU), same GGUF, at 1, 8 and 32 concurrent streaming clients: aggregate tok/s,
# p50/p99 TTFT and inter-token latency (benchmarks/serve.py --gpu).
#
# Here, first:   .venv/bin/python benchmarks/h200/prepare.py         (.gpucheck/h200: artifact, TVM runtime, llama.cpp)
#                .venv/bin/python benchmarks/h200/prepare_serve.py   (.gpucheck/serve: serving wheels, ~6 MiB)
# Then one device call, from the repository root, with carry
#   [".gpucheck/h200/bundle", ".gpucheck/h200/peer", ".gpucheck/h200/smollm2-135m", ".gpucheck/serve"]:
#                bash benchmarks/h200/serve.sh
# and here:      cp <files_at>/serve-<date>.json benchmarks/results/serve-<date>-h200.json (the .md likewise), then
#                .venv/bin/python benchmarks/plot.py; serve-logs.tgz holds the build, server and serve.py logs
#
# ~7-8 minutes: llama-server's CUDA build takes ~5 (niced, in the background) while the runtime is unpacked, the
# GGUF generated from its spec, weights.bin rebuilt from it, luce-compile's server checked end to end (2 requests,
# not timed) and the artifact by scripts/device_check.py (check.json, beside the record); then 6 levels (3 client counts × 2 servers, each server restarted per level) of REQUESTS requests of
# MAX_TOKENS tokens, ~2-3 minutes. serve.py writes its record after every level and gets only what is left of 580 s,
# so a slow build costs levels, not the record. CLIENTS, REQUESTS, MAX_TOKENS override the defaults; a warm machine
# reuses the build, the site dir and the GGUF under $W.
#
# DRAFT="TARGET DRAFT" (issue 39): speculative serving instead. Two workload folders of DRAFT_DIR (default
# .gpucheck/spec7b), each server without and with the draft model (serve.py --speculation off on: rows
# "luce-compile+draft", `serve --draft`, and "llama-server+draft", `-md --spec-type draft-simple
# --spec-draft-n-max 8 -ngld 99`), on the first REQUESTS HumanEval prompts as code completions, at CLIENTS clients.
# Here, first:   .venv/bin/python benchmarks/h200/prepare.py --dir .gpucheck/spec7b --no-reference \
#                  --workloads TARGET DRAFT
#                .venv/bin/python benchmarks/h200/prepare_serve.py
#                cp ~/.cache/luce-compile/data/HumanEval.jsonl.gz .gpucheck/spec7b/   (where benchmarks/spec.py, or
#                serve.py with a draft and no --code-prompts, fetched it; the GPU machine has no PyPI)
# Then one device call with carry [".gpucheck/spec7b", ".gpucheck/serve"]:
#                DRAFT="TARGET DRAFT" bash benchmarks/h200/serve.sh
# and here:      cp <files_at>/serve-<date>.json benchmarks/results/serve-<date>-h200-spec.json (the .md likewise).
# The pair must share a vocabulary: luce-compile serve refuses a draft with other rows, and serve.py --check says so
# before anything is set up (exit 2): qwen2.5-coder-1.5b-vocab and qwen2.5-coder-0.5b-vocab have 151936 rows each;
# qwen2.5-7b has 152064, which llama.cpp accepts (128 rows apart at most) and our runtime does not. Synthetic weights:
# the draft's greedy tokens are not the target's, so nearly every draft is rejected and the +draft rows measure what
# speculation costs each server when it does not pay (the "drafts accepted" column says how much it did).
# Defaults there: CLIENTS "1 8", REQUESTS 16, MAX_TOKENS 128, --ctx 1024 (the longest of the first 16 prompts is 580
# characters); the GGUF and weights.bin of both workloads are made as above; the smoke test serves the target with
# the draft (2 requests); no device_check run (the folders have no reference logits). ~9-10 minutes with a 7B target:
# setup ~2 (its GGUF and weights.bin ~1) under the build's ~3-5, then 8 levels (per client count: ours, llama-server,
# ours+draft, llama-server+draft), each server restarted per level, ~3.5 minutes in all (the longest, llama-server
# drafting 8 tokens a step that are rejected at 1 client, ~50 s); levels past 580 s are lost, in that order.
set -o pipefail
export PYTHONUNBUFFERED=1
H=.gpucheck/h200; S=.gpucheck/serve; A=$H/smollm2-135m/artifact
# outside the carried paths: a later call's carry replaces those, and a warm machine keeps this
W=${SERVE_WORK:-/tmp/luce-serve}; RAW=$W/raw-$(date +%H%M%S); OUT=${OUT:-/tmp/serve-out}
T=$H/smollm2-135m; CTX=512; SPEC=(); DEFAULTS=("1 8 32" 64 64)  # the target's folder; clients, requests, tokens
# the GGUF under the name the artifact was compiled from: luce-compile serves it as that model id, the requests name it
gguf_of() {
  echo "$W/$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['gguf_name'])" "$1/spec.json")"
}
if [ -n "${DRAFT:-}" ]; then
  set -- $DRAFT
  [ $# = 2 ] || { echo "DRAFT names two workloads, \"TARGET DRAFT\"; got '$DRAFT'"; exit 2; }
  H=${DRAFT_DIR:-.gpucheck/spec7b}; T=$H/$1; D=$H/$2; A=$T/artifact; CTX=1024; DEFAULTS=("1 8" 16 128)
  GD=$(gguf_of "$D")
  SPEC=(--draft-artifact "$D/artifact" --draft-model "$GD" --code-prompts "$H/HumanEval.jsonl.gz")
fi
CLIENTS=${CLIENTS:-${DEFAULTS[0]}}; REQUESTS=${REQUESTS:-${DEFAULTS[1]}}; MAX_TOKENS=${MAX_TOKENS:-${DEFAULTS[2]}}
G=$(gguf_of "$T")
# the pair's vocabularies, the HumanEval file and the options, in a second (serve.py imports nothing of ours for it)
if [ -n "${DRAFT:-}" ]; then
  python3 benchmarks/serve.py --model "$G" --artifact "$A" "${SPEC[@]}" --requests "$REQUESTS" --check || exit 2
fi
mkdir -p "$W" "$RAW" "$OUT"
echo "${LUCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" > "$RAW/commit.txt"
# the device tool returns at most 8 files: the record (2) and every log in one tarball
pack() { tar czf "$OUT/serve-logs.tgz" -C "$RAW" . ; }
start=$(date +%s); stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }

# llama-server from prepare.py's trimmed llama.cpp plus the one build script it drops (prepare_serve.py); no web UI.
# A build still running after 7 minutes is stopped: luce-compile's levels still run in what is left.
L=$W/llama.cpp/build/bin/llama-server
if [ ! -x "$L" ]; then
  rm -rf "$W/llama.cpp" && tar xzf $H/peer/llama.cpp.tgz -C "$W" && tar xzf $S/llama-server-extra.tgz -C "$W" || exit 3
  ( cd "$W/llama.cpp" && nice -n 19 cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      > "$RAW/cmake.log" 2>&1 && nice -n 19 timeout 420 cmake --build build -j 14 --target llama-server \
      > "$RAW/build.log" 2>&1
    echo "llama.cpp build rc=$?" ) &
  BUILD=$!
fi
SITE=$W/site
if [ ! -d "$SITE/fastapi" ]; then
  mkdir -p "$SITE" && tar xzf $H/bundle/tvm-runtime.tgz -C "$SITE" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $H/bundle/*.whl $S/wheels/*.whl ||
    exit 3
fi
export PYTHONPATH=$SITE:$PWD/runtime:$PWD
# weights.bin is not carried (prepare.py): rebuilt from the GGUF, each file checked against the manifest's sha256
python3 scripts/device_check.py gguf $T --gguf "$G" > "$RAW/weights.json" 2> "$RAW/weights.err" ||
  { stamp "GGUF or weights.bin failed: $(cat "$RAW/weights.json") $(tail -3 "$RAW/weights.err")"; pack; exit 4; }
stamp "GGUF and weights.bin: $(cat "$RAW/weights.json")"
if [ -n "${DRAFT:-}" ]; then  # the draft's too: llama-server reads its GGUF, luce-compile its artifact
  python3 scripts/device_check.py gguf $D --gguf "$GD" > "$RAW/weights-draft.json" 2> "$RAW/weights-draft.err" ||
    { stamp "draft GGUF or weights.bin failed: $(cat "$RAW/weights-draft.json") $(tail -3 "$RAW/weights-draft.err")"
      pack; exit 4; }
  stamp "draft GGUF and weights.bin: $(cat "$RAW/weights-draft.json")"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$RAW/gpu.csv"
python3 -m pip list 2>/dev/null | grep -iE "^(fastapi|pydantic|uvicorn|llguidance|anyio|torch) " > "$RAW/pip.txt"
# luce-compile's server end to end while llama.cpp builds (2 requests, nothing timed): a broken runtime shows in
# seconds, not after the build (DRAFT: the target serving with its draft)
python3 benchmarks/serve.py --servers luce-compile --model "$G" --artifact "$A" --gpu --clients 1 --requests 2 \
  --max-tokens 8 --quiet-wait-s 0 --retries 0 --out "$RAW/smoke" --logdir "$RAW/smoke" \
  ${DRAFT:+"${SPEC[@]}" --speculation on --ctx $CTX} > "$RAW/smoke.log" 2>&1
stamp "luce-compile serve smoke test rc=$? ($(grep -m1 -oE 'luce-compile(\+draft)? N=1: .* tok/s' "$RAW/smoke.log"))"
# the served artifact checked in the same call, still while llama.cpp builds (nothing is timed yet): logits against
# the oracle's, batched against alone, the megakernel against the per-op path, its device argmax plain and masked
if [ -z "${DRAFT:-}" ]; then
  python3 scripts/device_check.py run $T --gguf "$G" --no-timing --out "$OUT/check.json" > "$RAW/check.log" 2>&1
  stamp "served artifact's device check rc=$? ($(python3 -c "import json, sys
print({k: c['ok'] for k, c in json.load(open(sys.argv[1]))['checks'].items()})" "$OUT/check.json" 2>&1 | tail -1))"
fi
pack
PEER=(--servers luce-compile llama-server --llama-server "$L")
if [ -n "$BUILD" ]; then wait $BUILD; tail -2 "$RAW/build.log"; fi
[ -x "$L" ] || { PEER=(--servers luce-compile); stamp "no llama-server (its build.log is in serve-logs.tgz)"; }
stamp "llama.cpp built; serving benchmark at $CLIENTS clients"
# timed levels: one server at a time on the GPU, nothing else running; a level over 25% of the 16 cores taken by
# other processes is rerun once. What is left of 580 s (at least 60): the call's limit is 600.
LEFT=$(( 580 - ($(date +%s) - start) )); [ $LEFT -gt 60 ] || LEFT=60
timeout $LEFT python3 benchmarks/serve.py "${PEER[@]}" --model "$G" --artifact "$A" "${SPEC[@]}" --gpu \
  --clients $CLIENTS --requests $REQUESTS --max-tokens $MAX_TOKENS --ctx $CTX --max-foreign-pct 25 --quiet-wait-s 10 \
  --retries 1 --out "$OUT" --logdir "$RAW/servers" 2>&1 | tee "$RAW/serve.log"
stamp "serving benchmark rc=$?"
pack
