# The H200 table (benchmarks/results/h200-<date>.md): luce-compile, llama.cpp CUDA and torch on the same synthetic
# GGUFs, in one run on one GPU machine.
#
# Here, first:   .venv/bin/python benchmarks/h200/prepare.py           (writes .gpucheck/h200, < 64 MiB)
# Then one device call, from the repository root, with carry [".gpucheck/h200"]:
#                bash benchmarks/h200/run.sh
# and here:      .venv/bin/python benchmarks/h200/report.py <files_at of that call>
#
# Phase 1 (CPU): build llama.cpp (llama-bench, llama-batched-bench) from the carried source while the workloads'
# GGUFs are generated from their specs (the same bytes as on the build machine: the sha256 is checked).
# Phase 2 (GPU, one engine at a time, nothing else running): per workload, luce-compile's checks against the oracle,
# then luce-compile, torch and llama.cpp timings. WORKLOADS="a b" limits the set; a warm machine reuses the build and
# the GGUFs under .gpucheck/h200/work, so the set can also be split over two calls of 10 minutes.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
H=.gpucheck/h200; WORK=$H/work; OUT=${OUT:-/tmp/h200-out}
WORKLOADS=${WORKLOADS:-"smollm2-135m llama-1b-body llama-1b-body-bf16 qwen3-0.6b"}
mkdir -p "$WORK" "$OUT"
start=$(date +%s); stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }

L=$WORK/llama.cpp/build/bin
if [ ! -x "$L/llama-batched-bench" ]; then
  tar xzf $H/peer/llama.cpp.tgz -C "$WORK"
  ( cd "$WORK/llama.cpp" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      > "$OUT/cmake.log" 2>&1 && cmake --build build -j 12 --target llama-bench llama-batched-bench \
      > "$OUT/build.log" 2>&1; echo "llama.cpp build rc=$?" ) &
  BUILD=$!
fi
if [ ! -d "$WORK/site/tvm" ]; then
  mkdir -p "$WORK/site" && tar xzf $H/bundle/tvm-runtime.tgz -C "$WORK/site" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" $H/bundle/*.whl || exit 3
fi
export PYTHONPATH=$PWD/$WORK/site:$PWD/runtime:$PWD
for w in $WORKLOADS; do
  python3 scripts/device_check.py gguf $H/$w --gguf "$WORK/$w.gguf" > "$OUT/gguf-$w.log" 2>&1 &
done
wait $(jobs -p | grep -v "^${BUILD:-none}$") 2>/dev/null
stamp "GGUFs: $(ls -s --block-size=M $WORK/*.gguf | tr '\n' ' ')"
[ -n "$BUILD" ] && wait $BUILD && tail -2 "$OUT/build.log"
stamp "llama.cpp built"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv"
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" > "$OUT/versions.txt"
for w in $WORKLOADS; do
  G=$WORK/$w.gguf; O=$OUT/$w; mkdir -p "$O"
  python3 scripts/device_check.py run $H/$w --gguf "$G" --no-timing --out "$O/check.json" > "$O/check.log" 2>&1
  stamp "$w check rc=$?"
  python3 -m luce_runtime.bench $H/$w/artifact --prompt-len 512 --gen-len 128 --batch 8 --repeat 5 \
    --prefill-lens 2048 > "$O/ours.json" 2> "$O/ours.err"
  stamp "$w luce-compile rc=$?"
  python3 benchmarks/peers/torch_peer.py "$G" --out "$O/torch.json" > "$O/torch.log" 2>&1
  stamp "$w torch rc=$?"
  "$L/llama-bench" -m "$G" -p 512,2048 -n 128 -fa 1 -ngl 99 -r 5 -o json > "$O/llama_bench.json" 2> "$O/llama_bench.err"
  stamp "$w llama-bench rc=$?"
  "$L/llama-batched-bench" -m "$G" -c 8192 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8 -fa on -ngl 99 \
    --output-format jsonl > "$O/llama_batched.txt" 2>&1
  stamp "$w llama-batched-bench rc=$?"
done
stamp "done"
