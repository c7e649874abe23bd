# ncu on one batch-1 step of a prepared megakernel (scripts/megakernel_check.py prepare --dir D), for a device call
# after benchmarks/h200/megakernel.sh has unpacked the runtime on the same warm machine:
#   bash benchmarks/h200/megakernel_ncu.sh .gpucheck/mk8-new [MODEL]
# writes $OUT/ncu-<dir>-details.csv (every section's metrics) and $OUT/ncu-<dir>-source.csv.gz (stall samples per
# SASS instruction, by address: map them to opcodes with the cubin's SASS, `cuobjdump -sass`). Clocks are left alone
# (--clock-control none, device/METHOD.md).
D=${1:-.gpucheck/mk8-new}; N=$(basename $D)
OUT=${OUT:-/tmp/mk-out}; mkdir -p $OUT; W=/tmp/mk-work; export PYTHONPATH=$W/site:$PWD/runtime:$PWD
timeout ${NCU_T:-240} ncu --clock-control none --kernel-name regex:megakernel_b1 --launch-skip 12 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section SourceCounters --section LaunchStats --section Occupancy -f -o /tmp/$N \
  python3 scripts/megakernel_check.py run --dir $D --models ${2:-llama-3.1-8b} --work $W --no-oracle --out /tmp/$N-check.json > $OUT/ncu-$N.log 2>&1
echo "ncu rc=$?" >> $OUT/ncu-$N.log
ncu --import /tmp/$N.ncu-rep --page details --csv > $OUT/ncu-$N-details.csv 2>>$OUT/ncu-$N.log
ncu --import /tmp/$N.ncu-rep --page source --csv --print-source sass 2>>$OUT/ncu-$N.log | gzip > $OUT/ncu-$N-source.csv.gz
ls -la $OUT
