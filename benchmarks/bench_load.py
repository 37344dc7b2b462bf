"""Write a real-shaped random MoE checkpoint, then load it with moecc.from_pretrained and measure it.

    python benchmarks/bench_load.py write /data/ckpt --preset qwen3-30b-a3b --layers 24
    python benchmarks/bench_load.py load  /data/ckpt [--out benchmarks/results/checkpoint_load]

``write`` stores experts per expert (``mlp.experts.<e>.{gate,up,down}_proj.weight``), as the original
checkpoints do, one shard per decoder layer. ``load`` reports load time, peak host RSS (VmHWM, which counts
mapped file pages too) against the bound 1.1 × expert bytes + largest shard, and peak GPU memory.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from moecc.bench.presets import PRESETS


def _randn(*shape: int, generator: torch.Generator, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)


def write(directory: Path, preset: str, layers: int) -> None:
    fields = dict(PRESETS[preset])
    if fields["model_type"] != "qwen3_moe":
        raise SystemExit("write lays out Qwen3-MoE checkpoints only; pick a qwen3_moe preset")
    config = {**fields, "num_hidden_layers": layers, "torch_dtype": "bfloat16", "architectures": ["Qwen3MoeForCausalLM"]}
    hidden, inter, experts = fields["hidden_size"], fields["moe_intermediate_size"], fields["num_experts"]
    heads, kv_heads, head_dim = fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})

    shard("model-embed.safetensors", {
        "model.embed_tokens.weight": _randn(fields["vocab_size"], hidden, generator=g),
        "lm_head.weight": _randn(fields["vocab_size"], hidden, generator=g),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    })
    # One random draw of the expert tensors, rescaled per layer: random enough for loading, and fast to write.
    base_gate_up = _randn(experts, 2 * inter, hidden, generator=g)
    base_down = _randn(experts, hidden, inter, generator=g)
    for layer in tqdm(range(layers), desc="writing layers", unit="layer"):
        p = f"model.layers.{layer}."
        tensors = {
            p + "self_attn.q_proj.weight": _randn(heads * head_dim, hidden, generator=g),
            p + "self_attn.k_proj.weight": _randn(kv_heads * head_dim, hidden, generator=g),
            p + "self_attn.v_proj.weight": _randn(kv_heads * head_dim, hidden, generator=g),
            p + "self_attn.o_proj.weight": _randn(hidden, heads * head_dim, generator=g),
            p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "mlp.gate.weight": _randn(experts, hidden, generator=g),
        }
        scale = 1.0 + 0.01 * layer
        gate_up, down = base_gate_up * scale, base_down * scale
        for e in range(experts):
            tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter].clone()
            tensors[p + f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:].clone()
            tensors[p + f"mlp.experts.{e}.down_proj.weight"] = down[e].clone()
        shard(f"model-layer{layer:03d}.safetensors", tensors)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def rss_gb(field: str = "VmHWM") -> float:
    """Resident set size from /proc/self/status: VmHWM (peak) or VmRSS (now), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def load(directory: Path, out: Path) -> None:
    import moecc

    start = time.perf_counter()
    model = moecc.from_pretrained(directory, dtype=torch.bfloat16)
    load_s = time.perf_counter() - start
    device = model.moecc.device
    shards = sorted(directory.glob("*.safetensors"))
    largest_gb = max(s.stat().st_size for s in shards) / 1e9
    expert_gb = model.moecc.expert_bytes / 1e9
    result = dict(
        checkpoint=str(directory), layers=model.config.num_hidden_layers, checkpoint_gb=sum(s.stat().st_size for s in shards) / 1e9,
        load_s=load_s, expert_host_gb=expert_gb, peak_host_rss_gb=rss_gb(), host_rss_after_gb=rss_gb("VmRSS"),
        largest_shard_gb=largest_gb,
        rss_bound_gb=1.1 * expert_gb + largest_gb,
        peak_gpu_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
        device=str(device),
    )
    print(json.dumps(result, indent=2))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"load_{directory.name}.json").write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["write", "load"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint_load"))
    args = parser.parse_args()
    if args.action == "write":
        write(args.directory, args.preset, args.layers)
    else:
        load(args.directory, args.out)


if __name__ == "__main__":
    main()
