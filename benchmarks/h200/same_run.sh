# The H200 same-run table (benchmarks/results/h200/README.md): luce-compile and llama.cpp CUDA on one synthetic GGUF.
# Here, first:
#   python scripts/device_check.py prepare --preset smollm2-135m --target sm_90 --dir .gpucheck/smollm2 --bundle .gpucheck/bundle
#   mkdir -p .gpucheck/peer && tar czf .gpucheck/peer/llama.cpp.tgz -C <llama-cpp-python sdist>/vendor llama.cpp/{CMakeLists.txt,cmake,ggml,src,include,common,tools,vendor,licenses,app,LICENSE}
#     (leave out ggml/src/ggml-{cann,et,hexagon,metal,musa,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn,hip,rpc,blas}: ~7.6 MB)
# Then one device call: run "bash benchmarks/h200/same_run.sh" with carry [".gpucheck/smollm2", ".gpucheck/bundle", ".gpucheck/peer"].
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
P=.gpucheck/peer; B=.gpucheck/bundle; H=benchmarks/h200
mkdir -p /tmp/lc && tar xzf $P/llama.cpp.tgz -C /tmp/lc
( cd /tmp/lc/llama.cpp && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/cmake.log 2>&1 && cmake --build build -j 14 --target llama-bench llama-batched-bench > /tmp/build.log 2>&1; echo "build rc=$?" ) &
BUILD=$!
mkdir -p /tmp/site && tar xzf $B/tvm-runtime.tgz -C /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $B/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/runtime:$PWD
python3 scripts/device_check.py run .gpucheck/smollm2 --gguf /tmp/smollm2.gguf --out $OUT/smollm2.json > $OUT/smollm2.log 2>&1; echo "check rc=$?"
python3 $H/ours_batch.py .gpucheck/smollm2/artifact $OUT/ours_batch.json > $OUT/ours_batch.log 2>&1; echo "ours_batch rc=$?"
wait $BUILD; tail -3 /tmp/build.log
cp /tmp/build.log $OUT/build.log 2>/dev/null
L=/tmp/lc/llama.cpp/build/bin
$L/llama-bench -m /tmp/smollm2.gguf -p 512,2048 -n 128 -fa 1 -ngl 99 -o json > $OUT/llama_bench.json 2> $OUT/llama_bench.err; echo "llama-bench rc=$?"
$L/llama-batched-bench -m /tmp/smollm2.gguf -c 8192 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 1,8 -fa on -ngl 99 > $OUT/llama_batched.txt 2>&1; echo "batched rc=$?"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt
cat $OUT/smollm2.log | tail -5; cat $OUT/ours_batch.log | tail -3; cat $OUT/llama_bench.json | head -60; tail -12 $OUT/llama_batched.txt
