#!/bin/bash
# Ready for the next host call (not run in session 36: no machine started). From the repository root; writes
# under $OUT. The serial-gap A/B of session 35 (serial_ab.patch: MOECC_AB_OLD_SERIAL=1 restores the old
# per-gap average), at 512 tokens where the steps swung (about 5 minutes with the build).
(nproc; nvidia-smi --query-gpu=name --format=csv,noheader; uptime) > $OUT/host.txt
python setup.py build_ext --inplace -j 16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
mkdir -p .host/cache/moecc && cp benchmarks/results/host_2026-12-06_s31/call1/rates.json .host/cache/moecc/
export XDG_CACHE_HOME=.host/cache PYTHONPATH=.
patch -p1 < benchmarks/results/host_2026-12-06_s35/serial_ab.patch || exit 1
timeout 240 python benchmarks/hybrid_modes_ab.py --tokens 512,2048 --rounds 3 --setting new=split \
    --setting old=split:MOECC_AB_OLD_SERIAL=1 --setting gpu=gpu --out $OUT/serial > $OUT/serial.log 2>&1
echo serial rc $?
cat $OUT/serial/ab.md
