"""Shared builders for whole-model parity checks: the same weights and adapters in HF + PEFT and in moecc."""
from __future__ import annotations

import copy

import torch
from peft import LoraConfig, PeftModel, get_peft_model

import moecc
from moecc.models import FAMILIES
from moecc.tiny_models import tiny_model

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Fixed bounds, for results that round alike in moecc and HF + PEFT (bf16 / fp16 through the reference backend) and
# for kernel-level checks; float32 parity with HF + PEFT uses assert_as_accurate instead.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
# Float32 results differ from HF + PEFT's by what the CPU's BLAS blocking (its order of summation) leaves, which
# differs between CPUs; so each pipeline is measured against the exact result (the same model and adapters run in
# float64 through HF + PEFT), and moecc's error may be at most FLOAT32_FACTOR times HF + PEFT's own plus
# FLOAT32_FLOOR (a relative error a few float32 roundings wide, for results HF + PEFT happens to get almost exact).
# After one forward and backward the two errors are of one size (moecc's at most 2.1 x HF + PEFT's over ~1,000
# float32 tensors of the parity tests on an AVX2-only Zen 3). After optimizer steps a few early roundings, amplified,
# set each run's error, and the ratio spreads wider: TRAINED_FACTOR (at most 3.8 x there over 56 seeded runs of
# test_api.py's test_sgd_steps_then_saved_adapters_match set-up).
FLOAT32_FACTOR, TRAINED_FACTOR, FLOAT32_FLOOR = 4.0, 8.0, 1e-6


def rel_err(actual: torch.Tensor | float, expected: torch.Tensor | float) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (0 when both are zero); tensors or numbers."""
    actual, expected = (torch.as_tensor(t).detach().double().cpu() for t in (actual, expected))
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff if denom == 0 else diff / denom


def float64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of the HF (+ PEFT) ``model`` on the CPU, taken before it trains: the exact result that its
    float32 run and moecc's approximate."""
    twin = copy.deepcopy(model).to("cpu", torch.float64)
    hf = twin.get_base_model() if isinstance(twin, PeftModel) else twin
    hf.set_experts_implementation("eager")  # HF's loop over experts: torch's grouped products take no float64
    return twin


def assert_as_accurate(actual, hf, exact, what: str = "", factor: float = FLOAT32_FACTOR,
                       floor: float = FLOAT32_FLOOR) -> None:
    """moecc's ``actual`` is as close to ``exact`` as HF + PEFT's ``hf`` is (tensors or numbers, relative error):
    ``rel_err(actual, exact) <= factor * rel_err(hf, exact) + floor``."""
    hf_error, error = rel_err(hf, exact), rel_err(actual, exact)
    assert error <= factor * hf_error + floor, (
        f"{what}: moecc's relative error {error:.3g} > {factor:g} x HF + PEFT's {hf_error:.3g} + {floor:g}")


def lora_config(family: str, rank: int = 4, alpha: int = 8, **kwargs) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(FAMILIES[family].attention_targets),
                      target_parameters=list(EXPERT_TARGETS), **kwargs)


def randomize_lora(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Non-zero LoRA A and B everywhere, so the adapters change the output from the first step."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


def build_pair(family: str, dtype: torch.dtype, config: LoraConfig, seed: int = 0, random_lora: bool = True,
               device: str = "cpu", paradigm: str = "cocompute", backend: str = "reference",
               moecc_options: dict | None = None, **model_overrides) -> tuple[PeftModel, PeftModel]:
    """(HF + PEFT reference on the CPU, moecc model on ``device``) with identical base weights and adapters.

    ``backend`` defaults to the reference CPU math, which these pipeline-exact comparisons are about; the
    default engine (native kernels where they apply) is compared in ``tests/models/test_native_parity.py``.
    """
    base = tiny_model(family, dtype=dtype, seed=seed, **model_overrides)
    reference = _hf_peft(copy.deepcopy(base), config, seed, random_lora)
    engine = moecc.prepare(copy.deepcopy(base), lora_config=copy.deepcopy(config), device=device, paradigm=paradigm,
                           config=moecc.MoeccConfig(backend=backend, **(moecc_options or {})))
    engine.load_state_dict(reference.state_dict())
    engine.train()
    return reference, engine


def build_reference(family: str, dtype: torch.dtype, config: LoraConfig, seed: int = 0, random_lora: bool = True,
                    **model_overrides) -> PeftModel:
    """:func:`build_pair`'s HF + PEFT model alone (the same weights and adapters), for results recorded once."""
    return _hf_peft(tiny_model(family, dtype=dtype, seed=seed, **model_overrides), config, seed, random_lora)


def _hf_peft(base: torch.nn.Module, config: LoraConfig, seed: int, random_lora: bool) -> PeftModel:
    reference = get_peft_model(base, copy.deepcopy(config))
    if random_lora:
        randomize_lora(reference, seed + 100)
    reference.train()
    return reference


def batches(vocab_size: int, count: int, batch: int = 2, seq: int = 12, seed: int = 0, pad: bool = False):
    """Deterministic (input_ids, attention_mask, labels) batches; ``pad`` left-pads the first row."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        if pad:
            mask[0, : seq // 3] = 0
            labels[0, : seq // 3] = -100
        out.append((ids, mask, labels))
    return out


def forward_backward_both(reference: torch.nn.Module, engine: torch.nn.Module, batch: tuple, tolerance: float,
                          device: str | None = None) -> None:
    """One forward and backward of both models on ``batch`` = (ids, mask, labels), the engine's inputs moved to
    ``device`` if given; their logits agree within ``tolerance`` (relative error)."""
    ids, mask, labels = batch
    a = reference(input_ids=ids, attention_mask=mask, labels=labels)
    moved = [t if device is None else t.to(device) for t in batch]
    b = engine(input_ids=moved[0], attention_mask=moved[1], labels=moved[2])
    assert rel_err(b.logits, a.logits) <= tolerance
    a.loss.backward()
    b.loss.backward()


def assert_grads_match(reference: torch.nn.Module, engine: torch.nn.Module, tolerance: float) -> None:
    """Every trainable parameter's gradient agrees (relative error) between the two models, in order."""
    for (name, p), (_, q) in zip(reference.named_parameters(), engine.named_parameters()):
        if p.requires_grad:
            assert q.grad is not None, name
            err = rel_err(q.grad, p.grad)
            assert err <= tolerance, f"{name}: relative error {err:.3g} > {tolerance:g}"


def forward_backward_exact(reference: torch.nn.Module, engine: torch.nn.Module, exact: torch.nn.Module, batch: tuple,
                           device: str | None = None, factor: float = FLOAT32_FACTOR) -> None:
    """:func:`forward_backward_both` in float32, with ``exact`` (:func:`float64_twin` of ``reference``) run too:
    moecc's logits and loss are as accurate as HF + PEFT's (:func:`assert_as_accurate` with ``factor``)."""
    ids, mask, labels = batch
    a = reference(input_ids=ids, attention_mask=mask, labels=labels)
    moved = [t if device is None else t.to(device) for t in batch]
    b = engine(input_ids=moved[0], attention_mask=moved[1], labels=moved[2])
    c = exact(input_ids=ids, attention_mask=mask, labels=labels)
    assert_as_accurate(b.logits, a.logits, c.logits, "logits", factor)
    assert_as_accurate(b.loss, a.loss, c.loss, "loss", factor)
    for out in (a, b, c):
        out.loss.backward()


def assert_grads_as_accurate(reference: torch.nn.Module, engine: torch.nn.Module, exact: torch.nn.Module,
                             factor: float = FLOAT32_FACTOR) -> None:
    """Every trainable parameter's gradient in moecc is as accurate as HF + PEFT's (:func:`assert_as_accurate`
    with ``factor``), the three models' parameters taken in order."""
    for (name, p), (_, q), (_, e) in zip(reference.named_parameters(), engine.named_parameters(),
                                         exact.named_parameters()):
        if p.requires_grad:
            assert q.grad is not None, name
            assert_as_accurate(q.grad, p.grad, e.grad, name, factor)


def record(model: torch.nn.Module, out=None) -> dict:
    """What a pass of ``model`` leaves to compare with later (detached copies): ``out``'s logits and loss where
    given, and every trainable parameter's gradient by name. HF + PEFT's and the float64 run's results, which no
    moecc setting changes, can so be computed once for several tests (:func:`assert_as_accurate_as_recorded`)."""
    recorded = {"grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()
                          if p.requires_grad and p.grad is not None}}
    if out is not None:
        recorded.update(logits=out.logits.detach().clone(), loss=out.loss.detach().clone())
    return recorded


def assert_as_accurate_as_recorded(engine: torch.nn.Module, out, hf: dict, exact: dict,
                                   factor: float = FLOAT32_FACTOR) -> None:
    """The engine's pass (``out``, if given, and every trainable gradient) as accurate as HF + PEFT's recorded
    one (:func:`record`) against the float64 run's recorded one (:func:`assert_as_accurate` with ``factor``)."""
    if out is not None:
        assert_as_accurate(out.logits, hf["logits"], exact["logits"], "logits", factor)
        assert_as_accurate(out.loss, hf["loss"], exact["loss"], "loss", factor)
    trainable = {name: p for name, p in engine.named_parameters() if p.requires_grad}
    assert trainable.keys() == hf["grads"].keys() == exact["grads"].keys()
    for name, p in trainable.items():
        assert p.grad is not None, name
        assert_as_accurate(p.grad, hf["grads"][name], exact["grads"][name], name, factor)


def sgd_steps_recorded(reference: torch.nn.Module, data: list, lr: float) -> list[tuple[dict, dict]]:
    """HF + PEFT's ``reference`` (before it trains) and its :func:`float64_twin` trained by plain SGD at ``lr``,
    one step a batch of ``data`` = [(ids, mask, labels)]: each step's (HF + PEFT's, the float64 run's)
    :func:`record`. Cache it where several tests train the same model on the same batches."""
    models = (reference, float64_twin(reference))
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr) for m in models]
    steps = []
    for ids, mask, labels in data:
        outs = [model(input_ids=ids, attention_mask=mask, labels=labels) for model in models]
        for out in outs:
            out.loss.backward()
        steps.append(tuple(record(model, out) for model, out in zip(models, outs)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return steps


def train_as_accurately(engine: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list,
                        steps: list[tuple[dict, dict]]) -> None:
    """``engine`` trained by ``optimizer`` on ``data`` as HF + PEFT was in ``steps`` (:func:`sgd_steps_recorded`):
    at each step its logits, loss and gradients as accurate as HF + PEFT's (:func:`assert_as_accurate_as_recorded`;
    after the first step with the bound for trained results)."""
    for step, ((ids, mask, labels), (hf, exact)) in enumerate(zip(data, steps, strict=True)):
        out = engine(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert_as_accurate_as_recorded(engine, out, hf, exact, TRAINED_FACTOR if step else FLOAT32_FACTOR)
        optimizer.step()
        optimizer.zero_grad()
