#!/bin/bash
# From the repository root; writes under $OUT. One hybrid step's timeline at 2048 tokens (16 layers), the CPU part's
# kernel phases alone and while PCIe streams, then the auto expert cache against none (session 36's call_cache.sh
# A/B without its CUDA tests). About 9.5 minutes with the build.
(nproc; nvidia-smi --query-gpu=name --format=csv,noheader; uptime) > $OUT/host.txt
python setup.py build_ext --inplace -j 16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
mkdir -p .host/cache/moecc && cp benchmarks/results/host_2026-12-06_s31/call1/rates.json .host/cache/moecc/
export XDG_CACHE_HOME=.host/cache PYTHONPATH=. PYTHONUNBUFFERED=1
timeout ${TIMELINE_TIMEOUT:-120} python benchmarks/hybrid_timeline.py --layers 16 --tokens 2048 --warmup 4 \
    --out $OUT/timeline 2>&1 | grep -v Warning > $OUT/timeline.log
echo timeline rc ${PIPESTATUS[0]}; tail -25 $OUT/timeline.log
timeout 90 python benchmarks/bench_cpu_subset.py --tokens 2048,8192 --experts 28,128 --loads alone,stream --phases \
    2>&1 | grep -v Warning > $OUT/cpu_subset.log
echo cpu_subset rc ${PIPESTATUS[0]}; cat $OUT/cpu_subset.log
MOECC_OFFLOAD_CACHE_GB=auto timeout ${AB_TIMEOUT:-320} python benchmarks/hybrid_modes_ab.py \
    --tokens ${AB_TOKENS:-512,2048,8192} --rounds 2 --setting split=split --setting split-none=split:cache=off \
    --setting gpu=gpu --setting gpu-none=gpu:cache=off --out $OUT/auto 2>&1 | grep -v Warning > $OUT/auto.log
echo auto rc ${PIPESTATUS[0]}; cat $OUT/auto/ab.md
