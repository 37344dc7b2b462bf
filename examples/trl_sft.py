"""The demo fine-tune through TRL's ``SFTTrainer``: TRL applies the LoRA (``peft_config``), ``MoeccCallback``
hands the model to moecc when the trainer is built, before the optimizer exists.

Same model and data as finetune_lora.py. Checkpoints hold a standard PEFT adapter plus ``moecc_config.json``
(moecc's settings), and resume exactly.

    python examples/trl_sft.py [--steps 200] [--out outputs/trl_sft] [--resume outputs/trl_sft/checkpoint-100]
"""
from __future__ import annotations

import argparse
import logging

import moecc  # before torch: torch's OpenMP threads then sleep between ops (moecc/__init__.py)
import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from demo_data import DATA_FILE, char_tokenizer
from finetune_lora import DEMO_SHAPE
from moecc.integrations import MoeccCallback
from moecc.tiny_models import tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="outputs/trl_sft")
    parser.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("moecc").setLevel(logging.INFO)  # prepare's line: what runs where

    lines = DATA_FILE.read_text().split()
    train, held_out = Dataset.from_dict({"text": lines[:3500]}), Dataset.from_dict({"text": lines[3500:]})
    base = tiny_model("qwen3_moe", dtype=torch.float32, seed=0, **DEMO_SHAPE)
    training = SFTConfig(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=32, learning_rate=3e-3,
        lr_scheduler_type="constant", logging_steps=max(1, args.steps // 10), save_steps=max(1, args.steps // 2),
        report_to=[], seed=0, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, max_length=16,
    )
    trainer = SFTTrainer(model=base, args=training, train_dataset=train, eval_dataset=held_out,
                         processing_class=char_tokenizer(), peft_config=moecc.default_lora_config(base, rank=16),
                         callbacks=[MoeccCallback()])
    print("prepared by moecc:", trainer.model.moecc.paradigm, f"({len(trainer.model.moecc.layers)} MoE layers)")
    print(f"held-out before: loss {trainer.evaluate()['eval_loss']:.3f}")
    trainer.train(resume_from_checkpoint=args.resume)
    print(f"held-out after: loss {trainer.evaluate()['eval_loss']:.3f}")


if __name__ == "__main__":
    main()
