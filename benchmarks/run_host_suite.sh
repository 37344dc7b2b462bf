#!/usr/bin/env bash
# Every measurement the performance issues ask for, in one go, on a machine with a CUDA GPU (and an AMX CPU for
# the AMX kernel rows): the GPU/AMX-marked tests, the CPU-expert kernel table, and `moecc bench` with its
# defaults (Qwen3-30B-A3B shape, all 48 layers, 24 GB budget, 512/2048/8192 tokens). Results land in $1
# (default benchmarks/results); each markdown file starts with the command that made it.
#
#   bash benchmarks/run_host_suite.sh [OUT_DIR]
set -uo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python -m moecc.cli info
python -m pytest -q -p no:warnings -m "gpu or amx or not gpu" tests/test_native_experts.py tests/test_native_parity.py \
    tests/test_grouped_experts.py tests/paradigms tests/bench 2>&1 | tail -5
python benchmarks/bench_cpu_experts.py --shapes qwen3-30b-a3b --tokens 256,1024,4096,8192 --out "$out" 2>&1 \
    | grep -v '^|'
python -m moecc.cli bench --out "$out/bench" 2>&1 | grep -v "it/s\|s/it"
