"""How long a small host->GPU transfer takes while the copy engine has weight copies queued: a copy
(``Tensor.copy_``, on the compute stream) against a kernel reading the pinned buffer in place
(``StagingBuffers.read_on_device``), the two ways hybrid's CPU results can reach the GPU.

Queues ``--queued-mb`` of pinned weight copies on a side stream, then the transfer of ``--mb`` on the compute
stream, and times the compute stream from just before the transfer until the kernel that uses it has run.
Writes a table (markdown) and prints it.

    python benchmarks/probe_copy_queue.py --mb 2 --queued-mb 800 --reps 5
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from moecc.staging import StagingBuffers


def run_once(mode: str, staging: StagingBuffers, host: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
             slot: torch.Tensor, side: torch.cuda.Stream) -> float:
    out.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        slot.copy_(weights, non_blocking=True)  # the next layer's experts, queued first
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    if mode == "copy":
        out.add_(staging.to_device("out_copy", host))
    else:
        staging.read_on_device({"cpu_out": host}, lambda cpu_out: out.add_(cpu_out))
    end.record()
    torch.cuda.synchronize()
    if not torch.equal(out.cpu(), host):  # zeros plus the host values: exact in any dtype
        raise SystemExit(f"probe_copy_queue: the {mode} transfer gave wrong values")
    return begin.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=2.0, help="size of the transfer (the CPU part's output)")
    parser.add_argument("--queued-mb", type=float, default=800.0, help="weight copies queued before it")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_copy_queue needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    staging = StagingBuffers(device)
    host = torch.randn(int(args.mb * 1e6 / 2), dtype=torch.bfloat16)
    out = torch.zeros(host.shape, dtype=torch.bfloat16, device=device)
    weights = torch.empty(int(args.queued_mb * 1e6), dtype=torch.uint8, pin_memory=True)
    slot = torch.empty(weights.shape, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    times: dict[str, list[float]] = {"copy": [], "read in place": []}
    for _ in range(args.reps + 1):  # the first round warms up
        for mode in times:
            times[mode].append(run_once(mode, staging, host, out, weights, slot, side))
    lines = [f"`python benchmarks/probe_copy_queue.py --mb {args.mb} --queued-mb {args.queued_mb} --reps "
             f"{args.reps}`", "", f"{args.mb} MB to the GPU behind {args.queued_mb} MB of queued weight copies, ms "
             f"until the kernel using it has run (median, min-max of {args.reps})", "",
             "| transfer | median | min | max |", "|---|---|---|---|"]
    for mode, samples in times.items():
        kept = samples[1:]
        lines.append(f"| {mode} | {statistics.median(kept):.3f} | {min(kept):.3f} | {max(kept):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
