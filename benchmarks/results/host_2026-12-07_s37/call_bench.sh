#!/bin/bash
# From the repository root; writes under $OUT. `moecc bench` with its defaults (Qwen3-30B-A3B, 48 layers, LoRA r=8,
# 24 GB budget, 512 / 2048 / 8192 tokens, hybrid, offload and cocompute in one run), with the carried rates of session 31.
# Extra environment (MOECC_OFFLOAD_CACHE_GB=auto, say) is passed through. About 9 minutes with the build.
# PARADIGMS, TOKENS and BENCH_TIMEOUT cut the run down for a call with little device time left.
(nproc; nvidia-smi --query-gpu=name --format=csv,noheader; uptime; env | grep '^MOECC_') > $OUT/host.txt
python setup.py build_ext --inplace -j 16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
mkdir -p .host/cache/moecc && cp benchmarks/results/host_2026-12-06_s31/call1/rates.json .host/cache/moecc/
export XDG_CACHE_HOME=.host/cache PYTHONPATH=. PYTHONUNBUFFERED=1
timeout ${BENCH_TIMEOUT:-530} python -m moecc.cli bench --paradigms ${PARADIGMS:-hybrid,offload,cocompute} \
    --tokens ${TOKENS:-512,2048,8192} --out $OUT/bench48 2>&1 | grep -v Warning > $OUT/bench.log
echo bench rc ${PIPESTATUS[0]}
cat $OUT/bench48/bench.md | head -14
