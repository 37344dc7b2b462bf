"""Writes a paradigm comparison as markdown, JSON and two PNG plots a person can read.

Rows are dicts from ``moecc.bench.runner.run_case`` (plus ``predicted_step_s`` from ``moecc.bench.plan``). A row
with an ``error`` appears in the table with its text (and any times measured), and in the plots only as a
"not plotted" footnote.
"""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("paradigm", "tokens", "step_s", "step_min_s", "step_max_s", "predicted_step_s", "tokens_per_s",
           "peak_gpu_gb", "cpu_experts_s", "pcie_s", "gpu_wait_s", "gpu_other_s", "h2d_gb", "h2d_gbps_while_copying",
           "expert_compute_s", "gpu_kernels_s", "alloc_retries_per_step", "checkpointing")
MISSING = "–"  # not measured, or no prediction for that paradigm
UNITS_NOTE = (f"Times are seconds per training step (median; step_min_s and step_max_s the fastest and slowest "
              f"timed step), `_gb` columns are GB (10^9 bytes), "
              f"`{MISSING}` = not measured or no prediction. A row with an error has no plot point. "
              "cpu_experts_s: CPU time of the experts (co-compute); pcie_s: time the expert copies took (offload, "
              "mostly hidden behind compute); gpu_wait_s: time the device waited for either; expert_compute_s: "
              "expert math on the GPU (offload); gpu_other_s: the rest of the step (attention, dense layers, head, "
              "optimizer, host overhead); gpu_kernels_s: time the GPU spent in kernels in one profiled step "
              "(copies excluded); alloc_retries_per_step: GPU allocations that failed at the budget cap and were "
              "retried after emptying the allocator's cache (each synchronises the device).")


def _cell(value) -> str:
    if value is None:
        return MISSING
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict], title: str, command: str) -> str:
    lines = [f"# {title}", "", f"`{command}`", "", "| " + " | ".join(COLUMNS) + " | error |",
             "|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        cells = [_cell(row.get(column)) for column in COLUMNS] + [_cell(row.get("error", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", UNITS_NOTE]) + "\n"


def _not_plotted_note(rows: list[dict]) -> str:
    failed = list(dict.fromkeys(row["paradigm"] for row in rows if "error" in row))
    return f"not plotted (error in bench.md): {', '.join(failed)}" if failed else ""


def _nothing_measured(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, "no paradigm produced a measurement", transform=ax.transAxes, ha="center")


def _throughput_plot(plt, rows: list[dict], title: str, path: Path) -> None:
    ok = [row for row in rows if "error" not in row]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for paradigm in dict.fromkeys(row["paradigm"] for row in ok):
        sel = sorted((row for row in ok if row["paradigm"] == paradigm), key=lambda r: r["tokens"])
        ax.plot([r["tokens"] for r in sel], [r["tokens_per_s"] for r in sel], marker="o", label=paradigm)
    ax.set_xscale("log", base=2)
    counts = sorted({row["tokens"] for row in rows})
    ax.set_xticks(counts, [str(count) for count in counts])
    ax.minorticks_off()
    ax.set_xlabel("tokens per training step")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ok:
        ax.legend(title="paradigm")
    else:
        _nothing_measured(ax)
    _save(plt, fig, rows, path)


def _save(plt, fig, rows: list[dict], path: Path) -> None:
    """Notes the paradigms left out of a plot (their rows have errors), then writes and closes the figure."""
    fig.text(0.01, 0.01, _not_plotted_note(rows), fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _breakdown_plot(plt, rows: list[dict], title: str, path: Path) -> None:
    """Per row, the step as disjoint parts (what the device waited for, and the rest) and, beside it, how long the
    CPU experts and the PCIe copies were busy in it: both near the step's height is both sides working at once."""
    ok = [row for row in rows if "error" not in row]
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(ok) + 2), 5.5))
    x = list(range(len(ok)))
    bottom = [0.0] * len(ok)
    for key, label in (("cpu_wait_s", "waiting for the CPU experts"), ("copy_wait_s", "waiting for PCIe copies"),
                       ("expert_compute_s", "expert math on the GPU"),
                       ("gpu_other_s", "GPU: attention, dense layers, head; optimizer; host")):
        values = [row.get(key, 0.0) for row in ok]
        ax.bar([i - 0.12 for i in x], values, bottom=bottom, label=label, width=0.5)
        bottom = [b + v for b, v in zip(bottom, values)]
    for offset, key, color, label in ((0.2, "cpu_experts_s", "tab:blue", "CPU experts busy (beside the step)"),
                                      (0.32, "pcie_s", "tab:orange", "PCIe copies busy (beside the step)")):
        ax.bar([i + offset for i in x], [row.get(key, 0.0) for row in ok], width=0.1, color=color, alpha=0.55,
               hatch="//", edgecolor=color, label=label)
    ax.set_xticks(x, [f"{row['paradigm']}\n{row['tokens']}" for row in ok])
    ax.set_xlabel("paradigm, tokens per training step")
    ax.set_ylabel("seconds per training step")
    ax.set_title(f"Where a step goes — {title}")
    if ok:  # below the axes, so it never hides a bar nor squeezes the plot
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=9, frameon=False)
    else:
        _nothing_measured(ax)
    _save(plt, fig, rows, path)


def write_report(rows: list[dict], out: Path, title: str, command: str, rates: dict | None = None) -> list[Path]:
    """``out``/bench.md, bench.json, tokens_per_s.png, breakdown.png; returns the files written. ``rates``: the
    machine rates the predictions came from, kept in the JSON so a prediction can be checked later."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "bench.md", out / "bench.json", out / "tokens_per_s.png", out / "breakdown.png"]
    files[0].write_text(_table(rows, title, command))
    files[1].write_text(json.dumps({"title": title, "command": command, "rows": rows, "rates": rates}, indent=2,
                                    default=str))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _throughput_plot(plt, rows, title, files[2])
    _breakdown_plot(plt, rows, title, files[3])
    return files
