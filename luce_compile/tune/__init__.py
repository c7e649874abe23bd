"""The tune stage: search each tunable kernel's knobs per target, and keep the winners in autotune_logs/.

- workloads.py: a model's distinct kernels that a knobbed rule (luce_schedules.knobs.KnobbedRule) schedules, and
  the key their records are filed under;
- search.py: candidate knobs, each kernel built alone and timed (the CPU here; records' best per workload);
- bundle.py: GPU targets, timed where the compiler is not (luce_runtime.tune_bench), results ingested;
- records.py: the JSON-lines logs and the lookup `compile` does (codegen/pipeline.py's schedule pass);
- tuner.py: the entry the `luce-compile tune` command calls.
"""
