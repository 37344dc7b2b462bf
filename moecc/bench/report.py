"""Writes a paradigm comparison as markdown, JSON and two PNG plots a person can read."""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("paradigm", "tokens", "step_s", "predicted_step_s", "tokens_per_s", "peak_gpu_gb", "cpu_experts_s",
           "pcie_s", "gpu_wait_s", "gpu_other_s", "h2d_gb")


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def write_report(rows: list[dict], out: Path, title: str, command: str) -> list[Path]:
    """``out``/bench.md, bench.json, tokens_per_s.png, breakdown.png; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", f"`{command}`", "", "| " + " | ".join(COLUMNS) + " | error |",
             "|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in COLUMNS) + f" | {row.get('error', '')} |")
    files = [out / "bench.md", out / "bench.json"]
    files[0].write_text("\n".join(lines) + "\n")
    files[1].write_text(json.dumps({"title": title, "command": command, "rows": rows}, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [row for row in rows if "error" not in row]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for paradigm in dict.fromkeys(row["paradigm"] for row in ok):
        sel = sorted((row for row in ok if row["paradigm"] == paradigm), key=lambda r: r["tokens"])
        ax.plot([r["tokens"] for r in sel], [r["tokens_per_s"] for r in sel], marker="o", label=paradigm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per training step")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok) + 2), 4.5))
    labels = [f"{row['paradigm']}\n{row['tokens']}" for row in ok]
    bottom = [0.0] * len(ok)
    for key, label in (("cpu_experts_s", "CPU experts (device waits)"), ("pcie_s", "PCIe copies"),
                       ("gpu_other_s", "GPU and the rest")):
        values = [row.get(key, 0.0) for row in ok]
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per step")
    ax.set_title(f"Where a step goes — {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=120)
    plt.close(fig)
    return files + [out / "tokens_per_s.png", out / "breakdown.png"]
