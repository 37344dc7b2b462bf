#!/bin/bash
# From the repository root; writes under $OUT. For a call with under 800 s of device time: the build, the CPU
# part's kernel phases at 2048 tokens (28 coldest experts, alone and while PCIe streams, hybrid's `into` path),
# then `moecc bench` for hybrid and offload at 2048 tokens on the bench's 48-layer model. About 6 minutes;
# `NO_PHASES=1` leaves the phases out, `BENCH_TIMEOUT` (default 240 s) bounds the bench.
(nproc; nvidia-smi --query-gpu=name --format=csv,noheader; uptime; git log --oneline -1) > $OUT/host.txt
python setup.py build_ext --inplace -j 16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
mkdir -p .host/cache/moecc && cp benchmarks/results/host_2026-12-06_s31/call1/rates.json .host/cache/moecc/
export XDG_CACHE_HOME=.host/cache PYTHONPATH=. PYTHONUNBUFFERED=1
[ -z "$NO_PHASES" ] && timeout 80 python benchmarks/bench_cpu_subset.py --tokens 2048 --experts 28 --loads alone,stream --phases \
    2>&1 | grep -v Warning > $OUT/cpu_subset.log
echo cpu_subset rc ${PIPESTATUS[0]}; cat $OUT/cpu_subset.log
timeout ${BENCH_TIMEOUT:-240} python -m moecc.cli bench --paradigms hybrid,offload --tokens 2048 \
    --out $OUT/bench48 2>&1 | grep -v Warning > $OUT/bench.log
echo bench rc ${PIPESTATUS[0]}
head -14 $OUT/bench48/bench.md
