"""The README's main job: LoRA fine-tuning of a small built-in MoE with its routed experts on the CPU.

Builds a small random-weight Qwen3-MoE-style model, prepares it with moecc (attention, routers and shared parts
on the GPU if there is one, else everything on the CPU), trains LoRA on the shipped arithmetic data set
(examples/data, CC0) and prints the held-out loss and answer accuracy before and after.

    python examples/finetune_lora.py [--steps 300] [--device cpu] [--out outputs/finetune_lora]
        [--expert-format {bf16,fp8,int8,int4,mxfp4} [--int4-group {32,64,128}]] [--seed 0]

The demo model is float32. ``--expert-format`` trains its bfloat16 variant instead (experts of intermediate size
128, so that every int4 group divides both projections' inputs) with the routed experts' frozen weights held in
that format (``MoeccConfig.expert_format``): the same recipe, to compare formats side by side.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import moecc  # before torch: torch's OpenMP threads then sleep between ops (moecc/__init__.py)
import torch
from tqdm import tqdm

from demo_data import VOCAB_SIZE, answer_accuracy, load_split
from moecc.config import EXPERT_FORMATS, INT4_GROUP_SIZES
from moecc.tiny_models import tiny_model

DEMO_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                  num_experts_per_tok=2)
# The bf16 variant: int4's groups of up to 128 inputs must divide the down projection's input, the expert
# intermediate size.
BF16_SHAPE = {**DEMO_SHAPE, "moe_intermediate_size": 128}


@torch.no_grad()
def evaluate(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, device: torch.device):
    """(held-out loss, answer-character accuracy)."""
    model.eval()
    out = model(input_ids=ids.to(device), labels=labels.to(device))
    model.train()
    return out.loss.item(), answer_accuracy(out.logits.float().cpu(), ids)


def prepare_demo(args: argparse.Namespace) -> torch.nn.Module:
    """The demo model (float32, or its bf16 variant held in ``--expert-format``) with LoRA, prepared by moecc."""
    torch.manual_seed(args.seed)
    if args.expert_format is None:
        base = tiny_model("qwen3_moe", dtype=torch.float32, seed=args.seed, **DEMO_SHAPE)
        config = None
    else:
        base = tiny_model("qwen3_moe", dtype=torch.bfloat16, seed=args.seed, **BF16_SHAPE)
        group = {} if args.int4_group is None else {"int4_group_size": args.int4_group}
        config = dataclasses.replace(moecc.MoeccConfig.from_env(), expert_format=args.expert_format, **group)
    lora = moecc.default_lora_config(base, rank=args.rank)
    return moecc.prepare(base, lora_config=lora, device=args.device, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--out", default="outputs/finetune_lora", help="where the adapter is saved")
    parser.add_argument("--expert-format", default=None, choices=[f for f in EXPERT_FORMATS if f != "auto"],
                        help="train the bf16 variant with its experts held in this format (default: float32 demo)")
    parser.add_argument("--int4-group", type=int, default=None, choices=INT4_GROUP_SIZES,
                        help="inputs sharing one scale under --expert-format int4 (default: moecc's)")
    parser.add_argument("--seed", type=int, default=0, help="the model's random weights and the batches")
    args = parser.parse_args()
    model = prepare_demo(args)
    device = model.moecc.device
    trainable, _ = model.get_nb_trainable_parameters()
    experts = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".experts." in n)
    print(f"moecc {moecc.__version__}: {len(model.moecc.layers)} MoE layers, experts on the CPU "
          f"({model.moecc.expert_format}); dense on {device}")
    print(f"trainable parameters: {trainable:,} ({experts:,} of them expert LoRA, held in host memory)")

    train_ids, train_labels = load_split("train")
    eval_ids, eval_labels = load_split("eval")
    before = evaluate(model, eval_ids, eval_labels, device)
    print(f"held-out before: loss {before[0]:.3f}, answer accuracy {before[1]:.1%}")

    # fused: the Trainer's default, and ~4x faster than the for-each AdamW on the host-resident expert LoRA
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, fused=True)
    generator = torch.Generator().manual_seed(args.seed + 1)
    start = time.perf_counter()
    progress = tqdm(range(args.steps), desc="fine-tuning", unit="step", mininterval=1.0)
    for _ in progress:
        rows = torch.randint(0, len(train_ids), (args.batch,), generator=generator)
        loss = model(input_ids=train_ids[rows].to(device), labels=train_labels[rows].to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    elapsed = time.perf_counter() - start

    after = evaluate(model, eval_ids, eval_labels, device)
    tokens = args.steps * args.batch * train_ids.shape[1]
    print(f"held-out after:  loss {after[0]:.3f}, answer accuracy {after[1]:.1%} "
          f"(before: {before[0]:.3f}, {before[1]:.1%}); {tokens / elapsed:,.0f} tokens/s")
    model.save_pretrained(args.out)
    print(f"adapter saved to {args.out} (standard PEFT format)")
    if not after[0] < before[0]:
        raise SystemExit("the held-out loss did not improve")


if __name__ == "__main__":
    main()
