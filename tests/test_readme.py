"""The README's complete Python examples run as written, with its placeholders (``path``, ``ids``, ``model``,
``dataset``, ``tokenizer``) bound to a tiny model and data; the fragments with ``...`` in them are not programs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from moecc.tiny_models import tiny_model

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _block(containing: str) -> str:
    found = [b for b in _blocks() if b.startswith("import ") and containing in b and "=..." not in b.replace(" ", "")]
    assert len(found) == 1, f"README: expected one complete example with {containing!r}, found {len(found)}"
    return found[0]


def test_quick_start_example_trains_and_saves_a_peft_adapter(tmp_path, monkeypatch):
    saved = tmp_path / "model"
    tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(saved)
    monkeypatch.chdir(tmp_path)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    scope = {"path": str(saved), "ids": ids}
    exec(compile(_block("moecc.prepare("), "README quick start", "exec"), scope)
    model = scope["model"]
    assert model.moecc.paradigm == "cocompute" and model.moecc.layers
    assert (tmp_path / "my-adapter" / "adapter_model.safetensors").exists()
    assert torch.isfinite(scope["loss"]).item()


def test_trl_example_trains_through_the_callback(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from .integrations.test_trl import char_tokenizer, sums

    monkeypatch.chdir(tmp_path)
    code = _block("SFTTrainer(").replace("max_steps=200", "max_steps=3")  # fewer steps, otherwise as written
    scope = {"model": tiny_model("qwen2_moe", seed=1), "dataset": sums(), "tokenizer": char_tokenizer()}
    exec(compile(code, "README With TRL", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 3
    assert trainer.model.moecc.engine.metrics_since_reset() is not None
