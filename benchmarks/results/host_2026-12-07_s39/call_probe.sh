#!/bin/bash
# From the repository root; writes under $OUT. Hybrid's own split with 2, 3 and 4 slots (copies 1-3 layers ahead)
# on the bench's 48-layer model, interleaved; the CPU part's kernel phases alone and while PCIe streams; one hybrid
# step's timeline at 2048 tokens (16 layers). About 6 minutes with the build.
(nproc; nvidia-smi --query-gpu=name --format=csv,noheader; uptime) > $OUT/host.txt
python setup.py build_ext --inplace -j 16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
mkdir -p .host/cache/moecc && cp benchmarks/results/host_2026-12-06_s31/call1/rates.json .host/cache/moecc/
export XDG_CACHE_HOME=.host/cache PYTHONPATH=. PYTHONUNBUFFERED=1
timeout ${SLOTS_TIMEOUT:-180} python benchmarks/profile_hybrid.py --layers 48 --tokens ${SLOTS_TOKENS:-2048} \
    --rules own:2:w,own:3:w,own:4:w --rounds 2 --steps 2 --warmup 2 2>&1 | grep -v Warning > $OUT/slots.log
echo slots rc ${PIPESTATUS[0]}; grep -E "round|step " $OUT/slots.log | cut -c1-230
timeout 90 python benchmarks/bench_cpu_subset.py --tokens 2048,8192 --experts 28,128 --loads alone,stream --phases \
    2>&1 | grep -v Warning > $OUT/cpu_subset.log
echo cpu_subset rc ${PIPESTATUS[0]}; cat $OUT/cpu_subset.log
[ -n "$NO_TIMELINE" ] && exit 0  # a call with little device time left
timeout ${TIMELINE_TIMEOUT:-110} python benchmarks/hybrid_timeline.py --layers 16 --tokens 2048 --warmup 4 \
    --out $OUT/timeline 2>&1 | grep -v Warning > $OUT/timeline.log
echo timeline rc ${PIPESTATUS[0]}; tail -12 $OUT/timeline.log
