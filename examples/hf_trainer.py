"""The demo fine-tune through the Hugging Face ``Trainer`` with ``MoeccCallback``.

Same model and data as finetune_lora.py; the Trainer handles batching, the schedule, logging (with moecc's
per-step metrics) and checkpoints (each holds the adapter in PEFT format and can be resumed exactly).

    python examples/hf_trainer.py [--steps 300] [--out outputs/hf_trainer] [--resume outputs/hf_trainer/checkpoint-100]
"""
from __future__ import annotations

import argparse

import moecc  # before torch: torch's OpenMP threads then sleep between ops (moecc/__init__.py)
import torch
from transformers import Trainer, TrainingArguments

from demo_data import answer_accuracy, load_split
from finetune_lora import DEMO_SHAPE
from moecc.integrations import MoeccCallback
from moecc.tiny_models import tiny_model


class Rows(torch.utils.data.Dataset):
    def __init__(self, split: str) -> None:
        self.ids, self.labels = load_split(split)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="outputs/hf_trainer")
    parser.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    args = parser.parse_args()

    base = tiny_model("qwen3_moe", dtype=torch.float32, seed=0, **DEMO_SHAPE)
    callback = MoeccCallback(lora_config=moecc.default_lora_config(base, rank=16))
    model = callback.prepare(base)
    model.print_trainable_parameters()  # includes the expert LoRA held in host memory

    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=32, learning_rate=3e-3,
        lr_scheduler_type="constant", logging_steps=max(1, args.steps // 10), save_steps=max(1, args.steps // 3),
        report_to=[], seed=0, use_cpu=model.moecc.device.type == "cpu", dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Rows("train"), eval_dataset=Rows("eval"),
                      callbacks=[callback], compute_metrics=None)
    eval_ids, _ = load_split("eval")

    def report(when: str) -> None:
        loss = trainer.evaluate()["eval_loss"]
        with torch.no_grad():
            model.eval()
            logits = model(input_ids=eval_ids.to(model.moecc.device)).logits.float().cpu()
            model.train()
        print(f"held-out {when}: loss {loss:.3f}, answer accuracy {answer_accuracy(logits, eval_ids):.1%}")

    report("before")
    trainer.train(resume_from_checkpoint=args.resume)
    report("after")
    last = [entry for entry in trainer.state.log_history if "moecc/cpu_experts_s" in entry][-1]
    print("last logged moecc metrics:", {k: v for k, v in last.items() if k.startswith("moecc/")})


if __name__ == "__main__":
    main()
