#!/bin/bash
# From the repository root; writes under $OUT. `../host_2026-12-07_s37/call_bench.sh` for hybrid and offload only
# (co-compute, 2-5x slower than offload at these batches in every earlier run, takes most of the full run's time),
# 400 s at most: about 5 minutes with the build, for a call with little device time left.
PARADIGMS=${PARADIGMS:-hybrid,offload} BENCH_TIMEOUT=${BENCH_TIMEOUT:-400} \
    exec bash benchmarks/results/host_2026-12-07_s37/call_bench.sh
