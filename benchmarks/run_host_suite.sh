#!/usr/bin/env bash
# The benchmarks behind benchmarks/results/, on a machine with a CUDA GPU (and an AMX CPU for the AMX kernel
# table). Each part is sized to finish in under about 9 minutes on one H100 or H200 beside a 16-core Xeon, writes
# into its folder of benchmarks/results/ (or OUT_DIR), and puts the command, commit, hardware and date at the top
# of each table it writes.
#
#   bash benchmarks/run_host_suite.sh PART [OUT_DIR]
#
#   tests        the GPU- and AMX-marked tests (prints their summary; with OUT_DIR also writes tests.txt there)
#   kernels      one MoE layer of CPU experts, native kernels against the PyTorch loop: AMX where the CPU has it,
#                AVX512-BF16, and the panel kernel alone                                   -> cpu_experts/
#   paradigms48  moecc bench, Qwen3-30B-A3B shape, all 48 layers, 24 GB GPU budget, 512/2048/8192 tokens:
#                hybrid, offload, co-compute                                               -> paradigms_48_layers/
#   paradigms8   the same model cut to 8 layers under 80 GB, where it fits whole: the `gpu` paradigm too
#                                                                                          -> paradigms_8_layers/
#   load         write a random Qwen3-30B-A3B-shaped checkpoint of LOAD_LAYERS (40) layers, 51 GB, under
#                LOAD_DIR (default: a temporary folder), and load it with moecc.from_pretrained -> checkpoint_load/
#   soak         1,000 training steps per paradigm (at most 150 s each), host and GPU memory, threads and open
#                files sampled                                                             -> soak/
#   ab           two builds against each other: AB_OLD (a commit, or a built checkout) and AB_NEW (default: this
#                checkout), `moecc bench $AB_ARGS` alternating old, new, old, new, ... for AB_ROUNDS (3) rounds;
#                prints a table of medians and spreads per build. OUT_DIR: the scratch folder (default: a new one
#                under TMPDIR), kept. A commit is checked out with `git worktree add` and built in place.
#                AB_ARGS defaults to "--layers 16 --paradigms hybrid,offload --tokens 512,2048"; AB_TIMEOUT (300)
#                bounds each run, in seconds.
#
# First builds the native extension in place (`python setup.py build_ext --inplace`; SKIP_BUILD=1 skips it) and
# runs everything with this checkout first on PYTHONPATH.
set -uo pipefail
part="${1:-}"
parts="tests|kernels|paradigms48|paradigms8|load|soak|ab"
case "$part" in
  tests|kernels|paradigms48|paradigms8|load|soak|ab) ;;
  *) echo "usage: bash benchmarks/run_host_suite.sh PART [OUT_DIR]   (PART: $parts)" >&2; exit 2 ;;
esac
if [[ "$part" == ab && -z "${AB_OLD:-}" ]]; then
  echo "run_host_suite.sh ab: set AB_OLD to a commit or a built checkout" >&2; exit 2
fi
[[ -n "${2:-}" && "$2" != /* ]] && set -- "$1" "$PWD/$2"  # OUT_DIR as the caller named it
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
results="benchmarks/results"
case "$part" in
  tests) out="${2:-}" ;;
  kernels) out="${2:-$results/cpu_experts}" ;;
  paradigms48) out="${2:-$results/paradigms_48_layers}" ;;
  paradigms8) out="${2:-$results/paradigms_8_layers}" ;;
  load) out="${2:-$results/checkpoint_load}" ;;
  soak) out="${2:-$results/soak}" ;;
  ab) out="${2:-$(mktemp -d "${TMPDIR:-/tmp}/moecc-ab.XXXXXX")}" ;;
esac
[[ -n "$out" ]] && mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
jobs="$(nproc)"

build() {  # build TREE LOG: the native extension in place in TREE
  python -c "import pybind11" 2> /dev/null || {
    echo "run_host_suite.sh: building needs pybind11 (pip install 'pybind11>=2.12'), or SKIP_BUILD=1" >&2; return 1; }
  (cd "$1" && python setup.py build_ext --inplace -j "$jobs") > "$2" 2>&1 || {
    tail -30 "$2"; echo "run_host_suite.sh: the build in $1 failed" >&2; return 1; }
}
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  build_log="$(mktemp)"
  build "$root" "$build_log" || exit 1
  rm -f "$build_log"
fi

commit="$(git rev-parse --short HEAD)"
git diff --quiet HEAD -- moecc cpp setup.py benchmarks/*.py || commit="$commit (with uncommitted changes)"

stamp() {  # stamp FILE TITLE COMMAND: the header every results table starts with, above what the tool wrote
  python - "$1" "$2" "$3" "$commit" <<'PY'
import datetime
import os
import sys
from pathlib import Path

path, title, command, commit = sys.argv[1:5]
cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "CPU")
fields = [dict(tuple(part.strip() for part in line.split(":", 1)) for line in block.splitlines() if ":" in line)
          for block in cpuinfo.split("\n\n")]
cores = len({(f.get("physical id"), f.get("core id")) for f in fields if "core id" in f}) or os.cpu_count()
amx = " (AMX)" if " amx_tile" in cpuinfo else ""
mem = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")), 0) / 2**20
try:
    import torch
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception:  # the header still says what the CPU side is
    gpus = []
gpu = (("one " if len(gpus) == 1 else f"{len(gpus)} x ") + gpus[0] + " + ") if gpus else "no GPU; "
hardware = f"{gpu}{cores}-core {model}{amx}, {mem:.0f} GiB RAM"
lines = Path(path).read_text().splitlines()
if lines and lines[0].startswith("# "):  # the tool's own title: the header's title replaces it
    lines = lines[1:]
while lines and not lines[0].strip():
    lines = lines[1:]
if lines and lines[0].startswith("`"):  # the tool's own record of its command: the header gives the command
    rest = lines[0].split("`", 2)[2].strip() if lines[0].count("`") >= 2 else ""
    lines = ([rest.removeprefix("(").removesuffix(")")] if rest else []) + lines[1:]
    while lines and not lines[0].strip():
        lines = lines[1:]
head = [f"# {title}", "", f"- command: `{command}`", f"- commit: {commit}", f"- hardware: {hardware}",
        f"- date: {datetime.date.today().isoformat()}", ""]
Path(path).write_text("\n".join(head + lines) + "\n")
PY
}

bench() {  # bench TITLE ARGS...: moecc bench into $out, stamped
  local title="$1"; shift
  python -m moecc.cli bench "$@" --out "$out" 2>&1 | grep -v "it/s\|s/it\|Warning\|_warn_once"
  local status=${PIPESTATUS[0]}
  [[ -f "$out/bench.md" ]] && stamp "$out/bench.md" "$title" "moecc bench $* --out $out"
  return "$status"
}

status=0
case "$part" in
tests)
  python -m moecc.cli info
  # The tests that need this machine's GPU or AMX unit; the rest run anywhere.
  python -m pytest -q -p no:warnings -m "(gpu or amx) and not slow" tests 2>&1 | tail -15 \
      | { if [[ -n "$out" ]]; then tee "$out/tests.txt"; else cat; fi; }
  status=${PIPESTATUS[0]}
  ;;
kernels)
  # AMX where the CPU has it (auto), then the AVX512-BF16 kernels on the same CPU (skipped where it lacks them).
  cmd="python benchmarks/bench_cpu_experts.py --shapes qwen3-30b-a3b --tokens 256,1024,4096,8192 --isa auto --reps 5"
  $cmd --out "$out" 2>&1 | grep -v '^|' || status=1
  isa="$(python -c 'from moecc import _ops; print(_ops.best_isa())')"
  [[ -f "$out/cpu_experts_$isa.md" ]] && stamp "$out/cpu_experts_$isa.md" \
      "CPU experts: one Qwen3-30B-A3B MoE layer on ${isa^^}, native kernels against the PyTorch loop" "$cmd"
  if [[ "$isa" != avx512_bf16 ]] && python -c 'from moecc import _ops; _ops.check_isa("avx512_bf16")' 2>/dev/null; then
    cmd="python benchmarks/bench_cpu_experts.py --shapes qwen3-30b-a3b --tokens 256,1024,4096 --isa avx512_bf16"
    $cmd --out "$out" 2>&1 | grep -v '^|' || status=1
    [[ -f "$out/cpu_experts_avx512_bf16.md" ]] && stamp "$out/cpu_experts_avx512_bf16.md" \
        "CPU experts: one Qwen3-30B-A3B MoE layer on AVX512-BF16, native kernels against the PyTorch loop" "$cmd"
  fi
  python benchmarks/bench_panel_kernel.py --out "$out" 2>&1 | grep -v "^(" || status=1
  [[ -f "$out/panel_kernel.md" ]] && stamp "$out/panel_kernel.md" \
      "The panel kernel alone: TFLOP/s per ISA, one thread and all threads" "python benchmarks/bench_panel_kernel.py"
  ;;
paradigms48)
  bench "Paradigms: Qwen3-30B-A3B shape, all 48 layers, LoRA r=8, 24 GB GPU budget" \
      --paradigms hybrid,offload,cocompute --tokens 512,2048,8192 || status=$?
  ;;
paradigms8)
  # PEFT's whole-model `gpu` paradigm materialises the expert deltas (37 GB at 8192 tokens): 80 GB holds it.
  bench "Paradigms: Qwen3-30B-A3B shape, 8 layers, LoRA r=8, 80 GB GPU budget" \
      --layers 8 --gpu-budget 80 --paradigms cocompute,offload,hybrid,gpu || status=$?
  ;;
load)
  layers="${LOAD_LAYERS:-40}"
  scratch="${LOAD_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/moecc-load.XXXXXX")}"
  ckpt="$scratch/qwen3-30b-a3b_L$layers"
  python benchmarks/bench_load.py write "$ckpt" --layers "$layers" 2>&1 | grep -v "it/s\|s/it" || status=1
  python benchmarks/bench_load.py load "$ckpt" --out "$out" || status=1
  json="$out/load_qwen3-30b-a3b_L$layers.json"
  if [[ -f "$json" ]]; then
    python - "$json" <<'PY'
import json
import sys
from pathlib import Path

path = Path(sys.argv[1])
r = json.loads(path.read_text())
r["checkpoint"] = "CKPT"
path.write_text(json.dumps(r, indent=2) + "\n")
columns = ["layers", "checkpoint_gb", "expert_host_gb", "load_s", "peak_host_rss_gb", "rss_bound_gb", "peak_gpu_gb"]
lines = [f"Loaded to `{r['device']}`; peak host RSS against the bound 1.1 x expert bytes + the largest shard "
         f"({r['largest_shard_gb']:.2f} GB).", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
         "| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in columns) + " |"]
path.with_suffix(".md").write_text("\n".join(lines) + "\n")
PY
    stamp "${json%.json}.md" "Checkpoint load: a Qwen3-30B-A3B-shaped checkpoint of $layers layers through \`moecc.from_pretrained\`" \
        "python benchmarks/bench_load.py write CKPT --layers $layers && python benchmarks/bench_load.py load CKPT"
  fi
  [[ -z "${LOAD_DIR:-}" ]] && rm -rf "$scratch"
  ;;
soak)
  args="--preset qwen3-30b-a3b --layers 2 --tokens 512 --steps 1000 --warm-up 100 --gpu-budget 24"
  args="$args --paradigms cocompute,offload,hybrid --max-seconds 150"
  # shellcheck disable=SC2086
  python benchmarks/soak.py $args --out "$out" 2>&1 | grep "^|\|^\`" || status=1
  [[ -f "$out/soak.md" ]] && stamp "$out/soak.md" \
      "Soak: 1,000 LoRA training steps per paradigm, Qwen3-30B-A3B shape, 2 layers, 512 tokens" \
      "python benchmarks/soak.py $args --out $out"
  ;;
ab)
  ab_args="${AB_ARGS:---layers 16 --paradigms hybrid,offload --tokens 512,2048}"
  rounds="${AB_ROUNDS:-3}"
  worktrees=()
  trap 'for w in ${worktrees[@]+"${worktrees[@]}"}; do git -C "$root" worktree remove --force "$w"; done' EXIT
  tree_of() {  # tree_of NAME SPEC: sets tree to the checkout SPEC names (a folder as it is; a commit checked out
               # with git worktree and built)
    if [[ -d "$2" ]]; then tree="$(cd "$2" && pwd)"; return; fi
    tree="$out/tree_$1"
    git -C "$root" worktree add --detach "$tree" "$2" > /dev/null || return 1
    worktrees+=("$tree")
    build "$tree" "$out/build_$1.txt"
  }
  tree_of old "$AB_OLD" || exit 1
  old="$tree"
  tree_of new "${AB_NEW:-$root}" || exit 1
  new="$tree"
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/moecc/rates.json"
  for name in old new; do  # each build its own rate cache, seeded with this machine's where there is one
    mkdir -p "$out/cache_$name/moecc"
    [[ -f "$cache" && ! -f "$out/cache_$name/moecc/rates.json" ]] && cp "$cache" "$out/cache_$name/moecc/"
    tree="${!name}"
    where="$(cd "$tree" && PYTHONPATH="$tree" python -c 'import moecc; print(moecc.__file__)')"
    [[ "$where" == "$tree"/* ]] || { echo "run_host_suite.sh ab: $name imports moecc from $where, not $tree" >&2; exit 1; }
    echo "$name: $tree ($(git -C "$tree" rev-parse --short HEAD))"
  done
  for round in $(seq 1 "$rounds"); do
    for name in old new; do
      tree="${!name}"
      echo "round $round, $name: moecc bench $ab_args"
      # shellcheck disable=SC2086
      (cd "$tree" && PYTHONPATH="$tree" XDG_CACHE_HOME="$out/cache_$name" timeout "${AB_TIMEOUT:-300}" \
          python -m moecc.cli bench $ab_args --out "$out/${name}_$round" > "$out/${name}_$round.txt" 2>&1) \
          || echo "round $round, $name: exit status $? (see $out/${name}_$round.txt)"
    done
  done
  python - "$out" "$rounds" "$old" "$new" <<'PY'
import json
import statistics
import sys
from pathlib import Path

out, rounds, trees = Path(sys.argv[1]), int(sys.argv[2]), dict(zip(("old", "new"), sys.argv[3:5]))
steps = {}  # (paradigm, tokens) -> build -> the median step of each run
for name in trees:
    for r in range(1, rounds + 1):
        path = out / f"{name}_{r}" / "bench.json"
        for row in json.loads(path.read_text())["rows"] if path.exists() else []:
            if row.get("step_s"):
                steps.setdefault((row["paradigm"], row["tokens"]), {}).setdefault(name, []).append(row["step_s"])


def cell(values):
    if not values:
        return "–"
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}] ({len(values)})"


lines = [f"old: {trees['old']}", f"new: {trees['new']}", "",
         "Seconds a step: the median over rounds of each run's median, [the runs' range] (runs).", "",
         "| paradigm | tokens | old | new | new / old |", "|---|---|---|---|---|"]
for (paradigm, tokens), by in sorted(steps.items()):
    old, new = by.get("old", []), by.get("new", [])
    ratio = f"{statistics.median(new) / statistics.median(old):.3f}" if old and new else "–"
    lines.append(f"| {paradigm} | {tokens} | {cell(old)} | {cell(new)} | {ratio} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
print(f"\n{out}/summary.md; each run's table in {out}/<build>_<round>/")
PY
  ;;
esac
exit "$status"
