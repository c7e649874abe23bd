# The H200 table (benchmarks/results/h200-<date>.md): luce-compile, llama.cpp CUDA and torch on the same synthetic
# GGUFs, in one run on one GPU machine.
#
# Here, first:   .venv/bin/python benchmarks/h200/prepare.py           (writes .gpucheck/h200, < 64 MiB)
# Then one device call, from the repository root, with carry [".gpucheck/h200"]:
#                bash benchmarks/h200/run.sh
# and here:      tar xzf <files_at>/h200-run.tgz -C RUN && .venv/bin/python benchmarks/h200/report.py RUN
#
# Phase 1 (CPU): build llama.cpp (llama-bench, llama-batched-bench) from the carried source while the workloads'
# GGUFs are generated from their specs (the same bytes as on the build machine: the sha256 is checked).
# luce-compile's checks against the oracle run while llama.cpp builds (niced). Phase 2 (GPU, one engine at a time,
# nothing else running): per workload, luce-compile, torch and llama.cpp timings (medians of REPEAT runs). WORKLOADS="a b" limits the set; a warm machine reuses the build and
# the GGUFs under .gpucheck/h200/work, so the set can also be split over two calls of 10 minutes. LLAMA_CPP=0 skips
# llama.cpp (its build is 5 of the ~7 minutes): luce-compile and torch only, e.g. to re-measure after a change.
# UNTUNED=.gpucheck/h200-untuned (benchmarks/h200/prepare.py --untuned, carried too) also times each workload's
# artifact compiled without the tuning logs, right after the tuned one: tuned vs untuned in the same run.
# SPEC_TRACE=benchmarks/results/spec-<date>.json (with the pair among WORKLOADS: prepare.py --dir .gpucheck/spec
# --workloads qwen2.5-coder-1.5b qwen2.5-coder-0.5b, and H=.gpucheck/spec) then replays speculation on the pair;
# SPEC_PAIR="TARGET DRAFT" names another pair. Token trees (issue 39) replay where the trace has them (spec.py
# --drafters "draft model,prompt lookup,draft tree"): the 7B target with the 0.5B draft, forcing the 1.5B's trace:
#   here:  .venv/bin/python benchmarks/spec.py --drafters "draft model,prompt lookup,draft tree" --branch 0.1 \
#            --humaneval 8 --edits 8   (commit results/spec-<date>.json: the device call reads it from the tree)
#          .venv/bin/python benchmarks/h200/prepare.py --dir .gpucheck/spec7b --no-reference \
#            --workloads qwen2.5-7b qwen2.5-coder-0.5b-vocab
#   there (carry [".gpucheck/spec7b"]): H=.gpucheck/spec7b WORKLOADS="qwen2.5-7b qwen2.5-coder-0.5b-vocab" CHECKS="" \
#            SPEC_PAIR="qwen2.5-7b qwen2.5-coder-0.5b-vocab" SPEC_TRACE=benchmarks/results/spec-<date>.json \
#            LLAMA_CPP=0 TORCH=0 PROFILE=0 REPEAT=1 bash benchmarks/h200/run.sh
#   and here: report.py RUN (its replay section has the trees' acceptance per position).
# PEROP=1 also times each artifact's decode with the per-op kernels (bench --no-megakernel): ours-perop.json.
# SERVED=1 adds the served batch-invariance check to each workload's checks (device_check run --served: 8 concurrent
# greedy requests on `serve --deterministic`'s scheduler against each alone).
# LONG=32768 then times each workload's prefill of a LONG-token prompt and its decode at that depth (batch 1), ours
# and llama-bench's (-p LONG; -d LONG -n 32): report.py's prefill_LONG and decode_b1_ctxLONG (issue 38).
# TORCH=0 and PROFILE=0 leave out the torch peer and the megakernel's per-task profile (a call short of device time).
# A workload prepared elsewhere (prepare.py --dir .gpucheck/h200-8b) joins by a link: ln -s ../h200-8b/W $H/W.
# 8-bit megakernel matvecs: prepare.py --megakernel-q8 --dir .gpucheck/h200-q8, then H=.gpucheck/h200-q8 (the
# checks then hold the decode to REL_TOL_Q8; report.py names the build); add --megakernel-tf32 for the F16/BF16
# matvecs on tf32 tensor cores (the table of 2026-12-04: results/h200-2026-12-04-tf32.md).
# An artifact with megakernels also gets profile.json (benchmarks/h200/engine_profile.py): device time a step beside
# the host's wall clock, and one step's time task by task.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Raw outputs go to $RAW; $OUT gets them as one tarball, refreshed after every workload (the device tool returns at
# most 8 files, and whatever is there when a call runs out of time).
# H: the prepared folder (prepare.py --dir); WORK stays under .gpucheck/h200 so calls on one warm machine share the
# llama.cpp build and the unpacked runtime
H=${H:-.gpucheck/h200}; WORK=$PWD/.gpucheck/h200/work; RAW=$WORK/raw-$(date +%H%M%S); OUT=${OUT:-/tmp/h200-out}
WORKLOADS=${WORKLOADS:-"smollm2-135m llama-1b-body llama-1b-body-bf16 qwen3-0.6b"}; REPEAT=${REPEAT:-3}
mkdir -p "$WORK" "$RAW" "$OUT"
# the luce-compile commit measured: pass LUCE_COMMIT=<the commit here> (the device's copy of the tree may carry stale
# git metadata: a call at 50dad24 recorded the session's first commit)
echo "${LUCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" > "$RAW/commit.txt"
date -u +%FT%T+00:00 > "$RAW/date.txt"  # the record's date (report.py)
# written aside, then renamed: the checks' background jobs stamp (and pack) while the foreground does
pack() { tar czf "$OUT/.pack-$BASHPID" -C "$RAW" . && mv -f "$OUT/.pack-$BASHPID" "$OUT/h200-run.tgz"; }
# every step's files are packed as it ends (a call that runs out of time keeps what finished: a Qwen3 run lost its
# luce-compile and torch timings 2 s before llama.cpp's when packing waited for the workload's end)
start=$(date +%s); stamp() { echo "[$(( $(date +%s) - start ))s] $*"; [ -d "$RAW" ] && pack; }

L=$WORK/llama.cpp/build/bin
LLAMA_CPP=${LLAMA_CPP:-1}
if [ "$LLAMA_CPP" = 1 ] && [ ! -x "$L/llama-batched-bench" ]; then
  tar xzf $H/peer/llama.cpp.tgz -C "$WORK"
  ( cd "$WORK/llama.cpp" && nice -n 19 cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      > "$RAW/cmake.log" 2>&1 && nice -n 19 cmake --build build -j 14 --target llama-bench llama-batched-bench \
      > "$RAW/build.log" 2>&1; echo "llama.cpp build rc=$?" ) &
  BUILD=$!
fi
if [ ! -d "$WORK/site/tvm" ]; then
  mkdir -p "$WORK/site" && tar xzf $H/bundle/tvm-runtime.tgz -C "$WORK/site" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" $H/bundle/*.whl || exit 3
fi
export PYTHONPATH=$WORK/site:$PWD/runtime:$PWD
for w in $(echo $WORKLOADS ${CHECKS-} | tr ' ' '\n' | sort -u); do
  python3 scripts/device_check.py gguf $H/$w --gguf "$WORK/$w.gguf" > "$RAW/gguf-$w.log" 2>&1 &
done
wait $(jobs -p | grep -v "^${BUILD:-none}$") 2>/dev/null
stamp "GGUFs: $(ls -s --block-size=M $WORK/*.gguf | tr '\n' ' ')"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$RAW/gpu.csv"
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" > "$RAW/versions.txt"
# correctness first, while llama.cpp still builds (nothing here is timed); CHECKS="a b" (default: the timed set)
# checks other workloads, e.g. all four in the first of two calls while only two are timed, CHECKS="" none
for w in ${CHECKS-$WORKLOADS}; do
  mkdir -p "$RAW/$w" && cp $H/$w/spec.json "$RAW/$w/"  # how it was built, for the record
  python3 scripts/device_check.py run $H/$w --gguf "$WORK/$w.gguf" --no-timing ${SERVED:+--served} --out "$RAW/$w/check.json" \
    > "$RAW/$w/check.log" 2>&1
  stamp "$w check rc=$?"
done
pack
[ -n "$BUILD" ] && wait $BUILD && tail -2 "$RAW/build.log"
stamp "llama.cpp built"
# timings: one engine at a time, nothing else running
for w in $WORKLOADS; do
  G=$WORK/$w.gguf; O=$RAW/$w; mkdir -p "$O" && cp $H/$w/spec.json "$O/"  # (a workload not in CHECKS has no folder yet)
  python3 -m luce_runtime.bench $H/$w/artifact --prompt-len 512 --gen-len 128 --batch 8 --repeat $REPEAT \
    --prefill-lens 2048 > "$O/ours.json" 2> "$O/ours.err"
  stamp "$w luce-compile rc=$?"
  if [ "${PROFILE:-1}" = 1 ] && python3 -c "import json, sys
sys.exit('kernels' not in json.load(open(sys.argv[1])).get('megakernel', {}))" "$H/$w/artifact/manifest.json"; then  # device time a step beside the host's, and one step task by task
    python3 benchmarks/h200/engine_profile.py "$H/$w" --gguf "$G" --out "$O/profile.json" 2> "$O/profile.err"
    stamp "$w megakernel profile rc=$?"
  fi
  if [ "${PEROP:-0}" = 1 ]; then  # the same artifact decoding with the per-op kernels: megakernel vs per-op, same run
    python3 -m luce_runtime.bench $H/$w/artifact --prompt-len 512 --gen-len 128 --batch 8 --repeat $REPEAT \
      --no-megakernel > "$O/ours-perop.json" 2> "$O/ours-perop.err"
    stamp "$w luce-compile per-op rc=$?"
  fi
  if [ -n "$UNTUNED" ] && [ -d "$UNTUNED/$w/artifact" ]; then
    # the same model compiled --no-tune-logs (prepare.py --untuned): its weights are the tuned artifact's (tuning
    # changes schedules, never the weight layout; the engine checks the file against the manifest)
    cp "$H/$w/artifact/weights.bin" "$UNTUNED/$w/artifact/weights.bin" &&
      python3 -m luce_runtime.bench "$UNTUNED/$w/artifact" --prompt-len 512 --gen-len 128 --batch 8 --repeat $REPEAT \
        --prefill-lens 2048 > "$O/ours-untuned.json" 2> "$O/ours-untuned.err"
    stamp "$w luce-compile untuned rc=$?"
  fi
  if [ "${TORCH:-1}" = 1 ]; then  # TORCH=0 leaves the torch peer out (a short call: its rows read "not run")
    python3 benchmarks/peers/torch_peer.py "$G" --out "$O/torch.json" --repeat $REPEAT > "$O/torch.log" 2>&1
    stamp "$w torch rc=$?"
  fi
  if [ "$LLAMA_CPP" = 1 ]; then
    "$L/llama-bench" -m "$G" -p 512,2048 -n 128 -fa 1 -ngl 99 -r $REPEAT -o json > "$O/llama_bench.json" \
      2> "$O/llama_bench.err"
    stamp "$w llama-bench rc=$?"
    "$L/llama-batched-bench" -m "$G" -c 8192 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8 -fa on -ngl 99 \
      --output-format jsonl > "$O/llama_batched.txt" 2>&1
    stamp "$w llama-batched-bench rc=$?"
  fi
  if [ -n "${LONG:-}" ]; then  # issue 38: a LONG-token prompt's prefill, then decode at that depth (one sequence)
    # within the trained context with the 32 decoded tokens and bench's warm-up step (Qwen2.5-Coder's is 32,768:
    # LONG=32768 there is 32,735)
    N=$(python3 -c "import json, sys
print(min($LONG, int(json.load(open(sys.argv[1]))['config']['n_ctx_train']) - 33))" "$H/$w/artifact/manifest.json")
    python3 -m luce_runtime.bench $H/$w/artifact --prompt-len $N --gen-len 32 --batch 1 --repeat 1 \
      > "$O/ours-long.json" 2> "$O/ours-long.err"
    stamp "$w luce-compile at $N tokens rc=$?"
    if [ "$LLAMA_CPP" = 1 ]; then  # its f16 KV cache, flash attention; -d: decode after a depth-token prefill
      "$L/llama-bench" -m "$G" -p $N -n 0 -fa 1 -ngl 99 -r 1 -o json > "$O/llama_long_prefill.json" \
        2> "$O/llama_long_prefill.err"
      "$L/llama-bench" -m "$G" -p 0 -n 32 -d $N -fa 1 -ngl 99 -r 1 -o json > "$O/llama_long_decode.json" \
        2> "$O/llama_long_decode.err"
      stamp "$w llama-bench at $N tokens rc=$?"
    fi
  fi
  pack
done
if [ -n "${SPEC_TRACE:-}" ]; then  # issue 14: speculation replayed from the CPU run's trace (spec_replay.py's header)
  set -- ${SPEC_PAIR:-qwen2.5-coder-1.5b qwen2.5-coder-0.5b}
  python3 benchmarks/h200/spec_replay.py "$H/$1" "$H/$2" --trace "$SPEC_TRACE" --out "$RAW/spec-replay.json" \
    2> "$RAW/spec-replay.err"
  stamp "speculation replay rc=$?"
  pack
fi
stamp "done"
