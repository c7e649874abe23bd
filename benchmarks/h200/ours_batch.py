"""luce-compile's batched decode on the GPU machine (runtime only): bench_engine at batch 8 after a 512/128 prompt.

    python3 benchmarks/h200/ours_batch.py ARTIFACT_DIR OUT.json
"""

import json
import os
import sys
from pathlib import Path

os.environ["TVM_USE_RUNTIME_LIB"] = "1"  # before luce_runtime imports tvm
from luce_runtime.bench import bench_engine  # noqa: E402
from luce_runtime.engine import Engine, EngineOptions, load_device_api  # noqa: E402


def main(artifact: str, out_path: str) -> None:
    load_device_api("cuda")
    out = {}
    for prompt_len, batch in ((512, 8), (128, 8)):
        engine = Engine(artifact, EngineOptions(max_batch=8, max_context=prompt_len + 80, prefill_chunk=prompt_len))
        result = bench_engine(engine, prompt_len=prompt_len, gen_len=64, batch=batch, repeat=3)
        out[f"p{prompt_len}_b{batch}"] = result
        print(prompt_len, batch, result, flush=True)
        del engine  # frees its KV pool before the next one is made
    Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
