#!/bin/bash
# From the repository root; writes under $OUT. `moecc bench` at its defaults (Qwen3-30B-A3B, 48 layers, LoRA r=8,
# 24 GB budget, 512 / 2048 / 8192 tokens) for hybrid and offload only (co-compute, 2-5x slower than offload at these
# batches in every earlier run, takes most of the full run's time), with the carried rates of session 31. About 5
# minutes with the build, for a call with little device time left.
(nproc; nvidia-smi --query-gpu=name --format=csv,noheader; uptime; env | grep '^MOECC_') > $OUT/host.txt
python setup.py build_ext --inplace -j 16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
mkdir -p .host/cache/moecc && cp benchmarks/results/host_2026-12-06_s31/call1/rates.json .host/cache/moecc/
export XDG_CACHE_HOME=.host/cache PYTHONPATH=. PYTHONUNBUFFERED=1
timeout ${BENCH_TIMEOUT:-400} python -m moecc.cli bench --paradigms ${PARADIGMS:-hybrid,offload} \
    --tokens ${TOKENS:-512,2048,8192} --out $OUT/bench48 2>&1 | grep -v Warning > $OUT/bench.log
echo bench rc ${PIPESTATUS[0]}
cat $OUT/bench48/bench.md | head -14
