"""The README's main job: LoRA fine-tuning of a small built-in MoE with its routed experts on the CPU.

Builds a small random-weight Qwen3-MoE-style model, prepares it with moecc (attention, routers and shared parts
on the GPU if there is one, else everything on the CPU), trains LoRA on a synthetic sequence task, and prints
the held-out loss before and after. Run: ``python examples/finetune_lora.py [--steps 150] [--device cpu]``.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

import moecc
from moecc.tiny_models import tiny_model

DEMO_SHAPE = dict(vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                  num_experts_per_tok=2)


def make_sequences(count: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Arithmetic progressions modulo ``vocab``: learnable from context, impossible from the first token."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (count, 1), generator=g)
    step = torch.randint(1, 6, (count, 1), generator=g)
    return (start + step * torch.arange(length)) % vocab  # [count, length]


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, device: torch.device) -> float:
    model.eval()
    loss = model(input_ids=data.to(device), labels=data.to(device)).loss.item()
    model.train()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--out", default="outputs/finetune_lora", help="where the adapter is saved")
    args = parser.parse_args()

    base = tiny_model("qwen3_moe", dtype=torch.float32, seed=0, **DEMO_SHAPE)
    model = moecc.prepare(base, lora_config=None, device=args.device)  # default: rank 8 on attention + experts
    device = model.moecc.device
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    experts = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".experts." in n)
    print(f"moecc {moecc.__version__}: {len(model.moecc.layers)} MoE layers, experts on the CPU; dense on {device}")
    print(f"trainable parameters: {trainable:,} ({experts:,} of them expert LoRA, held in host memory)")

    vocab = DEMO_SHAPE["vocab_size"]
    held_out = make_sequences(64, args.seq, vocab, seed=1)
    before = evaluate(model, held_out, device)
    print(f"held-out loss before: {before:.3f}")

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    start = time.perf_counter()
    progress = tqdm(range(args.steps), desc="fine-tuning", unit="step")
    for step in progress:
        batch = make_sequences(args.batch, args.seq, vocab, seed=1000 + step).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress.set_postfix(loss=f"{loss.item():.3f}")
    elapsed = time.perf_counter() - start

    after = evaluate(model, held_out, device)
    tokens = args.steps * args.batch * args.seq
    print(f"held-out loss after:  {after:.3f} (before {before:.3f}); {tokens / elapsed:,.0f} tokens/s")
    model.save_pretrained(args.out)
    print(f"adapter saved to {args.out} (standard PEFT format)")
    if not after < before:
        raise SystemExit("the held-out loss did not improve")


if __name__ == "__main__":
    main()
