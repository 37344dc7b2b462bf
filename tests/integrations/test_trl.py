"""TRL's trainers on moecc models: SFT (a prepared model, or peft_config + MoeccCallback; packing), DPO and GRPO
(generation on the moecc model) give plain PEFT's losses on the same data (float32: each measured against the same
run in float64), checkpoint and resume exactly."""
from __future__ import annotations

import json

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from peft import get_peft_model  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import moecc  # noqa: E402
from moecc.integrations import MoeccCallback  # noqa: E402
from moecc.tiny_models import tiny_model  # noqa: E402

from ..parity import TRAINED_FACTOR, assert_as_accurate, float64_twin, lora_config  # noqa: E402
from .test_trainer import StopAfter  # noqa: E402

FAMILY = "qwen2_moe"
# bf16=False: TRL's configs default to bf16 autocast, which would run the float32 (and float64) models in bf16
COMMON = dict(per_device_train_batch_size=4, learning_rate=5e-3, logging_steps=1, report_to=[], use_cpu=True,
              save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0, bf16=False)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus pad / eos / bos / unk: no download needed."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({chr(code): len(specials) + i for i, code in enumerate(range(32, 127))})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def sums(count: int = 32) -> Dataset:
    return Dataset.from_dict({"text": [f"{a}+{b}={a + b}" for a in range(8) for b in range(4)][:count]})


def preferences() -> Dataset:
    rows = [(f"{a}+{b}=", f"{a + b}", f"{a + b + 1}") for a in range(4) for b in range(4)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                              "rejected": [r[2] for r in rows]})


def _base(exact: bool = False):
    """The tiny model; ``exact``: in float64, the run that float32's (plain PEFT's and moecc's) approximate."""
    model = tiny_model(FAMILY, seed=1)
    return float64_twin(model) if exact else model


def _losses(trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def _trainable(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _assert_same_run(moecc_trainer, plain_trainer, exact_trainer) -> None:
    """moecc's logged losses and trained LoRA are as close to the float64 run's as plain PEFT's are
    (parity.assert_as_accurate, with its bound for trained results)."""
    got, expected, exact = (_losses(t) for t in (moecc_trainer, plain_trainer, exact_trainer))
    assert got.keys() == expected.keys() == exact.keys() and got
    for step, loss in expected.items():
        assert_as_accurate(got[step], loss, exact[step], f"loss of step {step}", factor=TRAINED_FACTOR)
    plain, exact = _trainable(plain_trainer.model), _trainable(exact_trainer.model)
    for name, param in _trainable(moecc_trainer.model).items():
        assert_as_accurate(param, plain[name], exact[name], name, factor=TRAINED_FACTOR)




def _sft(tmp_path, name, callbacks=(), peft_config=None, model=None, steps=3, **overrides):
    args = trl.SFTConfig(output_dir=str(tmp_path / name), max_steps=steps, max_length=32,
                         **{**COMMON, **overrides})
    torch.manual_seed(0)  # the same LoRA initialisation wherever the trainer applies peft_config
    return trl.SFTTrainer(model=model if model is not None else _base(), args=args, train_dataset=sums(),
                          processing_class=char_tokenizer(), peft_config=peft_config, callbacks=list(callbacks))


def test_sft_peft_config_route_trains_the_experts_through_moecc(tmp_path):
    config = lora_config(FAMILY)
    plain = _sft(tmp_path, "plain", peft_config=config)
    plain.train()
    exact = _sft(tmp_path, "exact", peft_config=lora_config(FAMILY), model=_base(exact=True))
    exact.train()
    engine = _sft(tmp_path, "moecc", peft_config=lora_config(FAMILY), callbacks=[MoeccCallback()])
    model = engine.model
    assert model.moecc.paradigm == "cocompute" and len(model.moecc.layers) == 2  # prepared at __init__
    tokens_before = model.moecc.engine.metrics_since_reset()["tokens"]
    engine.train()
    assert engine.model is model  # the trainer's own PeftModel, adopted in place: one LoRA
    assert model.moecc.engine.metrics_since_reset()["tokens"] > tokens_before  # experts ran in moecc's engine
    assert model.moecc.engine.forward_passes >= 3
    for name, param in model.named_parameters():
        if ".experts." in name and "lora_" not in name:
            assert param.device.type == "cpu", name  # base experts in host memory
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == \
        sum("lora_A" in n for n, _ in plain.model.named_parameters())
    _assert_same_run(engine, plain, exact)


def test_sft_prepared_model_with_packing_matches_plain_peft(tmp_path):
    engine_model = moecc.prepare(_base(), lora_config=lora_config(FAMILY), device="cpu")
    plain_model = get_peft_model(_base(), lora_config(FAMILY))
    plain_model.load_state_dict(engine_model.state_dict())
    exact = _sft(tmp_path, "exact", model=float64_twin(plain_model), packing=True)
    exact.train()
    plain = _sft(tmp_path, "plain", model=plain_model, packing=True)
    plain.train()
    engine = _sft(tmp_path, "moecc", model=engine_model, callbacks=[MoeccCallback()], packing=True)
    engine.train()
    _assert_same_run(engine, plain, exact)


def test_sft_checkpoint_carries_settings_and_resumes_exactly(tmp_path):
    full = _sft(tmp_path, "full", peft_config=lora_config(FAMILY), callbacks=[MoeccCallback()], steps=4)
    full.train()
    first = _sft(tmp_path, "run", peft_config=lora_config(FAMILY), steps=4, save_strategy="steps", save_steps=100,
                 callbacks=[MoeccCallback(), StopAfter(2)])
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    settings = json.loads((checkpoint / "moecc_config.json").read_text())
    assert settings["paradigm"] == "cocompute" and settings["family"] == FAMILY and settings["lora"]["r"] == 4

    resumed = _sft(tmp_path, "run", peft_config=lora_config(FAMILY), steps=4, callbacks=[MoeccCallback()])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    expected, got = _losses(full), _losses(resumed)
    assert {3, 4} <= set(got)
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6)

    other = _sft(tmp_path, "other", peft_config=lora_config(FAMILY, rank=2), steps=4, callbacks=[MoeccCallback()])
    with pytest.raises(moecc.AdapterMismatchError, match="r: adapter 4, model 2"):
        other.train(resume_from_checkpoint=str(checkpoint))


def test_dpo_matches_plain_peft(tmp_path):
    runs = {}
    for name, callbacks in (("plain", []), ("moecc", [MoeccCallback()]), ("exact", [])):
        args = trl.DPOConfig(output_dir=str(tmp_path / name), max_steps=2, max_length=24, **COMMON)
        torch.manual_seed(0)
        runs[name] = trl.DPOTrainer(model=_base(exact=name == "exact"), args=args, train_dataset=preferences(),
                                    processing_class=char_tokenizer(), peft_config=lora_config(FAMILY),
                                    callbacks=callbacks)
        runs[name].train()
    assert hasattr(runs["moecc"].model, "moecc")
    _assert_same_run(runs["moecc"], runs["plain"], runs["exact"])


def _reward_length(completions, **kwargs) -> list[float]:
    return [float(len(text)) for text in completions]


def test_grpo_generates_on_the_moecc_model(tmp_path):
    """Small: 2 prompts x 2 generations of 4 tokens per step, 2 steps; generation runs through moecc's engine."""
    prompts = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)]})
    runs = {}
    for name, callbacks in (("plain", []), ("moecc", [MoeccCallback()]), ("exact", [])):
        args = trl.GRPOConfig(output_dir=str(tmp_path / name), max_steps=2, num_generations=2,
                              max_completion_length=4, **{**COMMON, "per_device_train_batch_size": 4})
        torch.manual_seed(0)
        runs[name] = trl.GRPOTrainer(model=_base(exact=name == "exact"), reward_funcs=_reward_length, args=args,
                                     train_dataset=prompts, processing_class=char_tokenizer(),
                                     peft_config=lora_config(FAMILY), callbacks=callbacks)
        runs[name].train()
    engine = runs["moecc"].model.moecc.engine
    assert engine.forward_passes > 2 * 4  # a pass per generated token besides training's
    _assert_same_run(runs["moecc"], runs["plain"], runs["exact"])
