#!/bin/bash
# Ready for the next host call (not run in session 36: no machine started). From the repository root; writes
# under $OUT. The CUDA cache tests, then the auto expert cache against none, split and every expert on the GPU,
# interleaved on one model (about 8 minutes with the build).
(nproc; nvidia-smi --query-gpu=name --format=csv,noheader; uptime) > $OUT/host.txt
python setup.py build_ext --inplace -j 16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
mkdir -p .host/cache/moecc && cp benchmarks/results/host_2026-12-06_s31/call1/rates.json .host/cache/moecc/
export XDG_CACHE_HOME=.host/cache PYTHONPATH=.
timeout 60 python -m pytest -q -m gpu tests/paradigms/test_expert_cache.py > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
MOECC_OFFLOAD_CACHE_GB=auto timeout 380 python benchmarks/hybrid_modes_ab.py --tokens ${AB_TOKENS:-512,2048,8192} --rounds 2 \
    --setting split=split --setting split-none=split:cache=off --setting gpu=gpu --setting gpu-none=gpu:cache=off \
    --out $OUT/auto > $OUT/auto.log 2>&1
echo auto rc $?
cat $OUT/auto/ab.md
