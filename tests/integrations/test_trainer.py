"""MoeccCallback in a real Trainer loop: metrics, exact resume, accumulation and checkpointing parity."""
from __future__ import annotations


import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments

import moecc
from moecc.integrations import MoeccCallback
from moecc.tiny_models import tiny_model

from ..parity import TRAINED_FACTOR, assert_as_accurate, float64_twin, lora_config, rel_err

FAMILY = "qwen2_moe"


class SequenceData(torch.utils.data.Dataset):
    def __init__(self, count: int = 32, length: int = 10, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _args(tmp_path, **overrides) -> TrainingArguments:
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6, learning_rate=5e-3,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                    dataloader_num_workers=0, lr_scheduler_type="linear", warmup_steps=1, disable_tqdm=True)
    settings.update(overrides)
    return TrainingArguments(**settings)


class StopAfter(TrainerCallback):
    """Interrupts training after ``step`` optimizer steps, as a crash or preemption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True


def _moecc_model():
    return moecc.prepare(tiny_model(FAMILY, seed=1), lora_config=lora_config(FAMILY), device="cpu")


def _losses(trainer: Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def test_metrics_reach_log_history_and_trainable_count(tmp_path):
    model = _moecc_model()
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=3), train_dataset=SequenceData(),
                      callbacks=[MoeccCallback()])
    assert isinstance(trainer.callback_handler.callbacks[0], MoeccCallback)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3
    for entry in logged:
        assert entry["moecc/cpu_experts_s"] > 0
        assert "moecc/h2d_gb" not in entry and "moecc/gpu_wait_s" not in entry  # no device: no link, no GPU
        assert entry["moecc/tokens_per_s"] > 0
        assert entry["moecc/routing_skew"] >= 1.0
        assert entry["moecc/expert_wait_s"] >= 0
    plain = get_peft_model(tiny_model(FAMILY, seed=1), lora_config(FAMILY))
    assert model.get_nb_trainable_parameters() == plain.get_nb_trainable_parameters()
    assert any(".experts." in n for n, p in model.named_parameters() if p.requires_grad)


def test_reporting_callbacks_registered_earlier_see_the_metrics(tmp_path):
    class Reporter(TrainerCallback):  # stands in for a report_to integration, which Trainer registers first
        seen: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs))

    reporter = Reporter()
    trainer = Trainer(model=_moecc_model(), args=_args(tmp_path, max_steps=2), train_dataset=SequenceData(),
                      callbacks=[reporter, MoeccCallback()])
    trainer.train()
    with_loss = [logs for logs in reporter.seen if "loss" in logs]
    assert with_loss and all("moecc/routing_skew" in logs for logs in with_loss)


def test_callback_prepares_a_plain_model_with_its_lora_config(tmp_path):
    callback = MoeccCallback(lora_config=lora_config(FAMILY, rank=2))
    trainer = Trainer(model=tiny_model(FAMILY, seed=1), args=_args(tmp_path, max_steps=2),
                      train_dataset=SequenceData(), callbacks=[callback])
    model = trainer.model  # prepared at Trainer.__init__, before train() creates the optimizer
    assert model.moecc.paradigm == "cocompute" and model.peft_config["default"].r == 2
    assert trainer.model_wrapped is model and trainer.callback_handler.model is model
    trainer.train()
    assert model.moecc.engine.forward_passes == 2
    assert all(p.shape[0] == 2 * 8 for n, p in model.named_parameters() if n.endswith("experts.lora_A.default.weight"))


def test_callback_settings_apply_or_are_refused(tmp_path):
    make = lambda model, callback: Trainer(model=model, args=_args(tmp_path), train_dataset=SequenceData(),  # noqa: E731
                                           callbacks=[callback])
    with pytest.raises(moecc.MoeccError, match="already prepared by moecc.prepare.*lora_config"):
        make(_moecc_model(), MoeccCallback(lora_config=lora_config(FAMILY)))
    with pytest.raises(moecc.MoeccError, match="peft_config"):
        make(get_peft_model(tiny_model(FAMILY), lora_config(FAMILY)), MoeccCallback(lora_config=lora_config(FAMILY)))
    with pytest.raises(moecc.MoeccError, match="MoeccCallback could not prepare the trainer's model.*'llama'"):
        from transformers import LlamaConfig, LlamaForCausalLM
        dense = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
        make(dense, MoeccCallback())
    with pytest.raises(TypeError, match="lora_cfg"):
        MoeccCallback(lora_cfg=lora_config(FAMILY))
    callback = MoeccCallback(lora_config=lora_config(FAMILY), device="cpu")
    model = callback.prepare(tiny_model(FAMILY))  # the documented two-step form still works
    assert make(model, callback).model is model


def test_resume_from_checkpoint_continues_exactly(tmp_path):
    full = Trainer(model=_moecc_model(), args=_args(tmp_path / "full"), train_dataset=SequenceData(),
                   callbacks=[MoeccCallback()])
    full.train()
    first = Trainer(model=_moecc_model(), args=_args(tmp_path / "run", save_strategy="steps", save_steps=100),
                    train_dataset=SequenceData(), callbacks=[MoeccCallback(), StopAfter(3)])
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-3"
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert any(".experts." in key for key in saved)

    resumed = Trainer(model=_moecc_model(), args=_args(tmp_path / "run"), train_dataset=SequenceData(),
                      callbacks=[MoeccCallback()])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    expected, got = _losses(full), _losses(resumed)
    assert {4, 5, 6} <= set(got)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6)
    final_full = {n: p for n, p in full.model.named_parameters() if p.requires_grad}
    for name, param in resumed.model.named_parameters():
        if param.requires_grad:
            assert rel_err(param, final_full[name]) <= 1e-5, name

    plain = PeftModel.from_pretrained(tiny_model(FAMILY, seed=1), checkpoint)
    exact = float64_twin(plain)
    ids = SequenceData()[0]["input_ids"][None]
    reference = _moecc_model()
    reference.load_state_dict(first.model.state_dict())
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for model in (reference.eval(), plain, exact)]
        assert_as_accurate(*logits, "the checkpoint in plain PEFT")


@pytest.mark.parametrize("overrides", [dict(gradient_accumulation_steps=2),
                                       dict(gradient_checkpointing=True),
                                       dict(gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": True})],
                         ids=["accumulation", "checkpointing", "checkpointing-reentrant"])
def test_trainer_matches_plain_hf_peft(tmp_path, overrides):
    engine = _moecc_model()
    plain = get_peft_model(tiny_model(FAMILY, seed=1), lora_config(FAMILY))
    plain.load_state_dict(engine.state_dict())
    exact = float64_twin(plain)
    losses, trained = {}, {}
    for name, model, callbacks in (("plain", plain, []), ("moecc", engine, [MoeccCallback()]), ("exact", exact, [])):
        trainer = Trainer(model=model, args=_args(tmp_path / name, max_steps=4, **overrides),
                          train_dataset=SequenceData(), callbacks=callbacks)
        trainer.train()
        losses[name] = _losses(trainer)
        trained[name] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert losses["moecc"].keys() == losses["plain"].keys() == losses["exact"].keys()
    for step, loss in losses["plain"].items():
        assert_as_accurate(losses["moecc"][step], loss, losses["exact"][step], f"loss of step {step}",
                           factor=TRAINED_FACTOR)
    for name, param in trained["plain"].items():
        assert_as_accurate(trained["moecc"][name], param, trained["exact"][name], name, factor=TRAINED_FACTOR)


@pytest.mark.gpu
def test_trainer_on_cuda_keeps_experts_in_host_memory(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = moecc.prepare(tiny_model(FAMILY, seed=1), lora_config=lora_config(FAMILY), device="cuda")
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=3, use_cpu=False), train_dataset=SequenceData(),
                      callbacks=[MoeccCallback()])
    trainer.train()
    for name, param in model.named_parameters():
        assert param.device.type == ("cpu" if ".experts." in name else "cuda"), name
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(entry["moecc/h2d_gb"] > 0 and entry["moecc/d2h_gb"] > 0 for entry in logged)


def test_callback_logs_offload_metrics(tmp_path):
    model = moecc.prepare(tiny_model(FAMILY, seed=1), lora_config=lora_config(FAMILY), device="cpu",
                          paradigm="offload")
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=SequenceData(),
                      callbacks=[MoeccCallback()])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(entry["moecc/tokens_per_s"] > 0 for entry in logged)
    assert all("moecc/h2d_gb" not in entry for entry in logged)  # "device" is the CPU: nothing crosses a link
