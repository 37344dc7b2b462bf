"""Whole-model parity of moecc.prepare against the unmodified Hugging Face model + PEFT (float32: each measured
against the same model run in float64, parity.assert_as_accurate)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import load_file

import moecc
from moecc.tiny_models import tiny_model

from .parity import (
    FLOAT32_FACTOR,
    TOLERANCE,
    TRAINED_FACTOR,
    assert_as_accurate,
    assert_grads_as_accurate,
    assert_grads_match,
    batches,
    build_pair,
    float64_twin,
    forward_backward_both,
    forward_backward_exact,
    lora_config,
    randomize_lora,
    rel_err,
)

FAMILIES = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "mixtral", "olmoe", "gpt_oss"]
DTYPES = [torch.float32, torch.bfloat16]


def _train(model, data, lr=0.05):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for ids, mask, labels in data:
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _assert_parity(actual, hf, exact, dtype, what, factor=FLOAT32_FACTOR):
    """float32: moecc as accurate as HF + PEFT against the float64 ``exact`` (parity.assert_as_accurate); bf16 and
    fp16, which the reference backend rounds as HF + PEFT does: within TOLERANCE of HF + PEFT."""
    if dtype == torch.float32:
        assert_as_accurate(actual, hf, exact, what, factor=factor)
    else:
        assert rel_err(actual, hf) <= TOLERANCE[dtype], what


@pytest.mark.parametrize("paradigm", ["cocompute", "offload"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_grads_match_hf_peft(family, dtype, paradigm):
    reference, engine = build_pair(family, dtype, lora_config(family), paradigm=paradigm)
    models = {"hf": reference, "moecc": engine}
    if dtype == torch.float32:
        models["exact"] = float64_twin(reference)
    (ids, mask, labels), = batches(reference.config.vocab_size, 1, pad=True)
    outs = {key: model(input_ids=ids, attention_mask=mask, labels=labels) for key, model in models.items()}
    for out in outs.values():
        out.loss.backward()
    grads = {key: {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
             for key, model in models.items()}
    exact_out, exact_grads = outs.get("exact"), grads.get("exact", {})
    for field in ("logits", "loss"):
        _assert_parity(getattr(outs["moecc"], field), getattr(outs["hf"], field),
                       None if exact_out is None else getattr(exact_out, field), dtype, field)
    assert grads["hf"].keys() == grads["moecc"].keys()
    assert any("experts" in n for n in grads["moecc"]) and any("attn" in n for n in grads["moecc"])
    for name, grad in grads["hf"].items():
        assert grads["moecc"][name] is not None, name
        assert grads["moecc"][name].device.type == "cpu"
        _assert_parity(grads["moecc"][name], grad, exact_grads.get(name), dtype, name)


@pytest.mark.parametrize("paradigm", ["cocompute", "offload"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_sgd_steps_then_saved_adapters_match(family, dtype, paradigm, tmp_path):
    config = lora_config(family, rank=4, alpha=16)
    # PEFT's default init (B = 0): in bf16 the first updates of a zero B are dominated by rounding (HF + PEFT in
    # bf16 differs from itself in float32 by >20% there), so this only passes if bf16 rounds like HF + PEFT.
    reference, engine = build_pair(family, dtype, config, seed=1, random_lora=False, paradigm=paradigm)
    models = {"hf": reference, "moecc": engine}
    if dtype == torch.float32:
        models["exact"] = float64_twin(reference)
    data = batches(reference.config.vocab_size, 4, seed=3)
    losses = {key: _train(model, data) for key, model in models.items()}
    for step in range(len(data)):
        exact_loss = losses["exact"][step] if "exact" in losses else None
        _assert_parity(losses["moecc"][step], losses["hf"][step], exact_loss, dtype, f"loss of step {step}",
                       factor=TRAINED_FACTOR)
    saved = {}
    for key, model in models.items():
        model.save_pretrained(tmp_path / key)
        saved[key] = load_file(tmp_path / key / "adapter_model.safetensors")
    assert saved["hf"].keys() == saved["moecc"].keys()
    assert any(k.endswith("mlp.experts.base_layer.lora_A.weight") for k in saved["moecc"])
    assert any(k.endswith("mlp.experts.lora_B.weight") for k in saved["moecc"])
    # The trained adapters carry that rounding through four updates of a zero B: gpt-oss in bf16 reached 3.0% on
    # an AVX2-only Zen 3 (torch's bf16 kernels without AVX-512 round elsewhere; under 2% on AVX-512 CPUs), so bf16
    # adapters get twice the losses' tolerance.
    for key, value in saved["hf"].items():
        if dtype == torch.bfloat16:
            assert rel_err(saved["moecc"][key], value) <= 2 * TOLERANCE[dtype], key
        else:
            _assert_parity(saved["moecc"][key], value, saved.get("exact", {}).get(key), dtype, key,
                           factor=TRAINED_FACTOR)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_adapter_reloads_in_peft_and_moecc(family, tmp_path):
    reference, engine = build_pair(family, torch.float32, lora_config(family, rank=2, alpha=4), seed=2)
    _train(engine, batches(engine.config.vocab_size, 2, seed=4), lr=0.1)
    engine.save_pretrained(tmp_path)
    (ids, mask, _), = batches(engine.config.vocab_size, 1, seed=9)
    engine.eval()
    with torch.no_grad():
        expected = engine(input_ids=ids, attention_mask=mask).logits

    plain = PeftModel.from_pretrained(tiny_model(family, seed=2), tmp_path)
    exact = float64_twin(plain)
    reloaded = moecc.prepare(tiny_model(family, seed=2), adapter=tmp_path, device="cpu")
    with torch.no_grad():
        hf, want = (model(input_ids=ids, attention_mask=mask).logits for model in (plain, exact))
        assert_as_accurate(expected, hf, want, "trained in moecc")  # what plain PEFT loaded is what moecc saved
        assert_as_accurate(reloaded(input_ids=ids, attention_mask=mask).logits, hf, want, "reloaded in moecc")
    assert any(p.requires_grad for n, p in reloaded.named_parameters() if "experts" in n)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_receives_routing_weight_gradient(family):
    """Every router gets HF + PEFT's gradient, and that gradient predicts the loss change when it is perturbed."""
    reference, engine = build_pair(family, torch.float32, lora_config(family), seed=5)
    exact = float64_twin(reference)
    (ids, mask, labels), = batches(engine.config.vocab_size, 1, seed=6)

    def loss64(model):  # float64 cross-entropy, so a small perturbation is far above rounding
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    routers = {}
    for model in (reference, engine, exact):
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.requires_grad_(True)
                routers.setdefault(name, []).append(param)
    assert routers
    for model in (reference, engine, exact):
        loss64(model).backward()
    for name, (ref_param, eng_param, exact_param) in routers.items():
        assert ref_param.grad.abs().sum() > 0
        assert_as_accurate(eng_param.grad, ref_param.grad, exact_param.grad, name)

    eps = 1e-3  # small enough that no token changes its experts
    for name, (_, router, _) in routers.items():
        direction = router.grad / router.grad.norm()
        with torch.no_grad():
            router.add_(eps * direction)
            plus = loss64(engine).item()
            router.sub_(2 * eps * direction)
            minus = loss64(engine).item()
            router.add_(eps * direction)
        finite_difference = (plus - minus) / (2 * eps)
        assert finite_difference == pytest.approx(router.grad.norm().item(), rel=1e-2), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family,overrides", [
    ("qwen3_moe", dict(num_experts_per_tok=4, norm_topk_prob=False)),
    ("qwen3_moe", dict(num_experts=5, num_hidden_layers=3)),
    ("qwen2_moe", dict(num_experts_per_tok=1, norm_topk_prob=True)),
    ("deepseek_v3", dict(n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    ("deepseek_v2", dict(topk_method="greedy", n_shared_experts=1)),
    ("gpt_oss", dict(swiglu_limit=0.05, num_experts_per_tok=3)),  # the clamps are active
])
def test_parity_holds_for_other_routing_settings(family, overrides, dtype):
    config = lora_config(family, rank=3, alpha=5, use_rslora=True)
    reference, engine = build_pair(family, dtype, config, seed=7, **overrides)
    batch, = batches(engine.config.vocab_size, 1, batch=3, seq=7, seed=8, pad=True)
    if dtype == torch.float32:
        exact = float64_twin(reference)
        forward_backward_exact(reference, engine, exact, batch)
        assert_grads_as_accurate(reference, engine, exact)
    else:
        forward_backward_both(reference, engine, batch, TOLERANCE[dtype])
        assert_grads_match(reference, engine, TOLERANCE[dtype])


def test_experts_only_lora_and_attention_only_lora():
    for kwargs in (dict(target_modules=None), dict(target_parameters=None)):
        config = lora_config("qwen2_moe")
        for key, value in kwargs.items():
            setattr(config, key, value)
        reference, engine = build_pair("qwen2_moe", torch.float32, config, seed=3)
        exact = float64_twin(reference)
        batch, = batches(engine.config.vocab_size, 1, seed=2)
        forward_backward_exact(reference, engine, exact, batch)
        assert_grads_as_accurate(reference, engine, exact)


def test_experts_stay_in_host_memory_across_device_moves():
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    engine.to("meta")  # any device move; meta needs no GPU
    for name, param in engine.named_parameters():
        expected = "cpu" if ".experts." in name else "meta"
        assert param.device.type == expected, name
    assert engine.moecc.expert_bytes == sum(
        p.nbytes for n, p in engine.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))
    )


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_device_matches_cpu_reference(family):
    """Attention on the GPU, experts on the CPU: same loss, logits and gradients as HF + PEFT (fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference, engine = build_pair(family, torch.float32, lora_config(family), seed=4, device="cuda")
    exact = float64_twin(reference)
    torch.backends.cuda.matmul.allow_tf32 = False
    batch, = batches(engine.config.vocab_size, 1, seed=1, pad=True)
    forward_backward_exact(reference, engine, exact, batch, device="cuda")
    for name, q in engine.named_parameters():
        if q.requires_grad:
            assert q.device.type == ("cpu" if ".experts." in name else "cuda"), name
    assert_grads_as_accurate(reference, engine, exact)
    assert engine.moecc.engine.staging.pinned


@pytest.mark.parametrize("paradigm,device,lora_place", [
    ("cocompute", "cpu", "auto"), ("offload", "cpu", "auto"),
    pytest.param("offload", "cuda", "device", marks=pytest.mark.gpu),
    pytest.param("offload", "cuda", "host", marks=pytest.mark.gpu)])
def test_peft_adapter_state_is_followed(paradigm, device, lora_place):
    """disable_adapter(), merge_adapter() and set_adapter() act on the experts as they do in PEFT; an adapter
    added after prepare is placed where the engine reads its factors (offload: on the GPU, or pinned)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    reference, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), seed=3, device=device,
                                   paradigm=paradigm, moecc_options={"offload_lora": lora_place})
    exact = float64_twin(reference)  # on the CPU
    (ids, _, labels), = batches(engine.config.vocab_size, 1, seed=5)
    ids, labels = ids.to(device), labels.to(device)
    reference.to(device)

    def assert_logits_as_accurate(state):
        assert_as_accurate(engine(input_ids=ids).logits, reference(input_ids=ids).logits,
                           exact(input_ids=ids.cpu()).logits, state)

    with torch.no_grad():
        with reference.disable_adapter(), engine.disable_adapter(), exact.disable_adapter():
            assert_logits_as_accurate("adapter disabled")
        for model in (reference, engine, exact):
            model.add_adapter("second", lora_config("qwen3_moe"))
        randomize_lora(reference, 11)
        engine.load_state_dict(reference.state_dict())
        exact.load_state_dict(reference.state_dict())
        for model in (reference, engine, exact):
            model.set_adapter("second")
        assert_logits_as_accurate("second adapter")
        for model in (reference, engine, exact):
            model.merge_adapter()
        assert_logits_as_accurate("merged")
        for model in (reference, engine, exact):
            model.unmerge_adapter()
    engine(input_ids=ids, labels=labels).loss.backward()
    second = [n for n, p in engine.named_parameters() if ".experts." in n and ".second." in n and p.grad is not None]
    first = [n for n, p in engine.named_parameters() if ".experts." in n and ".default." in n and p.grad is not None]
    assert second and not first
    if device == "cuda":
        factors = [p for n, p in engine.named_parameters() if ".experts." in n and ".second." in n]
        assert all(p.is_cuda if lora_place == "device" else p.is_pinned() for p in factors)


def test_merge_and_unload_gives_the_merged_hf_model():
    """PEFT's merge_and_unload through moecc's merge counting (lora.track_merges) returns the plain model with
    the adapter folded in, as HF + PEFT's does."""
    reference, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    exact = float64_twin(reference)
    (ids, _, _), = batches(engine.config.vocab_size, 1, seed=1)
    with torch.no_grad():
        merged = [model.merge_and_unload() for model in (reference, engine, exact)]
        assert not isinstance(merged[1], PeftModel)
        hf, moecc_logits, want = (model(input_ids=ids).logits for model in merged)
        assert_as_accurate(moecc_logits, hf, want, "merged")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_prepare_adopts_a_peft_model_as_it_is(family):
    from peft import get_peft_model

    built = get_peft_model(tiny_model(family, seed=4), lora_config(family))  # as TRL's peft_config builds it
    randomize_lora(built, seed=5)
    reference = get_peft_model(tiny_model(family, seed=4), lora_config(family))
    reference.load_state_dict(built.state_dict())
    exact = float64_twin(reference)
    before = {n: p.detach().clone() for n, p in built.named_parameters() if "lora_" in n}
    engine = moecc.prepare(built, device="cpu")
    assert engine is built and engine.moecc.family.model_type == family
    after = {n: p for n, p in engine.named_parameters() if "lora_" in n}
    assert after.keys() == before.keys()  # no second LoRA
    assert all(torch.equal(after[n], before[n]) for n in before)
    for batch in batches(reference.config.vocab_size, 2, seed=6):
        forward_backward_exact(reference, engine, exact, batch)
    assert_grads_as_accurate(reference, engine, exact)
    assert engine.moecc.engine.metrics_since_reset()["tokens"] > 0


def test_prepare_refuses_peft_models_it_cannot_adopt():
    from peft import get_peft_model

    with pytest.raises(moecc.MoeccError, match="already carries LoRA.*second one"):
        moecc.prepare(get_peft_model(tiny_model("qwen3_moe"), lora_config("qwen3_moe")),
                      lora_config=lora_config("qwen3_moe"), device="cpu")
    from peft import IA3Config

    with pytest.raises(moecc.MoeccError, match="IA3Config; moecc trains LoRA only"):
        moecc.prepare(get_peft_model(tiny_model("qwen3_moe"), IA3Config(target_modules=["q_proj"],
                                                                        feedforward_modules=[])), device="cpu")
    prepared = moecc.prepare(tiny_model("qwen3_moe"), device="cpu")
    with pytest.raises(moecc.MoeccError, match="already prepared by moecc"):
        moecc.prepare(prepared, device="cpu")


def test_prepare_logs_what_runs_where(caplog, monkeypatch):
    with caplog.at_level("INFO", logger="moecc"):
        moecc.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16), device="cpu")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("moecc prepared"))
    assert "paradigm=cocompute" in line and "2 x bfloat16: CPU native (" in line
    assert "threads=" in line and "gpu budget=none" in line
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    caplog.clear()
    with caplog.at_level("INFO", logger="moecc"):
        moecc.prepare(tiny_model("qwen3_moe"), device="cpu")
    warning, = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "float32" in warning and "reference backend" in warning and "dtype=torch.bfloat16" in warning
    for cache, said in (("auto", "expert cache: none (host and device are one memory)"),
                        (0.5, "expert cache 0.5 GB")):
        caplog.clear()
        with caplog.at_level("INFO", logger="moecc"):
            moecc.prepare(tiny_model("qwen3_moe"), device="cpu", paradigm="offload",
                          config=moecc.MoeccConfig(offload_cache_gb=cache))
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("moecc prepared"))
        assert said in line
    from moecc.paradigms import offload

    monkeypatch.setattr(offload, "cache_setting", lambda device, config: (0, 10**9))  # as on a GPU
    caplog.clear()
    with caplog.at_level("INFO", logger="moecc"):
        moecc.prepare(tiny_model("qwen3_moe"), device="cpu", paradigm="offload",
                      config=moecc.MoeccConfig(offload_cache_gb="auto"))
    assert any("expert cache: what the GPU budget (or free memory) leaves at each batch size" in r.getMessage()
               for r in caplog.records)


def test_saved_settings_travel_with_the_adapter(tmp_path):
    config = moecc.MoeccConfig(offload_slots=3, check_finite=True)
    model = moecc.prepare(tiny_model("qwen3_moe"), lora_config=lora_config("qwen3_moe"), device="cpu",
                          paradigm="offload", config=config)
    model.save_pretrained(tmp_path)
    settings = json.loads((tmp_path / "moecc_config.json").read_text())
    assert settings["paradigm"] == "offload" and settings["config"]["offload_slots"] == 3
    reloaded = moecc.prepare(tiny_model("qwen3_moe"), adapter=tmp_path, device="cpu")
    assert reloaded.moecc.paradigm == "offload" and reloaded.moecc.config == config
    assert moecc.prepare(tiny_model("qwen3_moe"), adapter=tmp_path, device="cpu",
                         paradigm="cocompute").moecc.paradigm == "cocompute"
    PeftModel.from_pretrained(tiny_model("qwen3_moe"), tmp_path)  # plain PEFT ignores the file

    other = moecc.prepare(tiny_model("qwen3_moe"), lora_config=lora_config("qwen3_moe", rank=2, alpha=8),
                          device="cpu")
    with pytest.raises(moecc.AdapterMismatchError, match="r: adapter 4, model 2") as error:
        other.load_adapter(str(tmp_path), "default", is_trainable=True)
    assert "lora_alpha" not in str(error.value)  # only what differs
    settings["family"] = "mixtral"
    (tmp_path / "moecc_config.json").write_text(json.dumps(settings))
    with pytest.raises(moecc.AdapterMismatchError, match="family: adapter mixtral, model qwen3_moe"):
        reloaded.load_adapter(str(tmp_path), "default", is_trainable=True)
