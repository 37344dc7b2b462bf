"""The native CPU expert kernels, on every ISA this machine runs, against the reference (bf16 tolerance)."""
from __future__ import annotations

import pytest
import torch

from moecc import _ops
from moecc.experts import reference
from moecc.experts.native import NativeExperts
from moecc.experts.types import ExpertLora, ExpertWeights, PairGrads

from ..parity import rel_err


# Every ISA the hardware offers, not only those that pass their self-check: on an AMX CPU whose AMX kernels are
# broken, the AMX cases must fail here rather than drop out of the table.
ISAS = _ops.hardware_isas()


def _problem(tokens, experts, hidden, inter, top_k, rank, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    weights = ExpertWeights((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).bfloat16(),
                            (torch.randn(experts, hidden, inter, generator=g) * 0.1).bfloat16())

    def lora(n_in, n_out):
        if rank == 0:
            return None
        return ExpertLora(torch.randn(rank * experts, n_in, generator=g) * 0.1,
                          torch.randn(n_out, rank * experts, generator=g) * 0.1, 1.5, experts)

    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    scores = torch.rand(tokens, experts, generator=g)
    if skew:
        scores[:, 0] += 2.0  # every token picks expert 0: one very hot expert
    scores[:, experts - 1] = -1.0  # and one expert gets no token at all
    index = scores.topk(top_k, dim=1).indices
    weights_routing = torch.rand(tokens, top_k, generator=g)
    return weights, x, index, weights_routing, lora(hidden, 2 * inter), lora(inter, hidden)


CASES = [  # tokens, experts, hidden, inter, top_k, rank, skew
    (1, 4, 32, 16, 2, 4, False),
    (37, 6, 48, 40, 3, 2, False),     # H and I not multiples of 16/32
    (64, 8, 64, 32, 2, 0, True),      # no LoRA, hot expert
    (130, 5, 96, 24, 2, 8, True),     # more rows than one token block
    (0, 4, 32, 16, 2, 4, False),
    (50, 5, 80, 40, 2, 12, False),    # rank above one register group of 8; column tails
    (300, 4, 64, 48, 2, 4, True),     # a hot expert with more rows than a 256-row elementwise block
    (40, 20, 100, 40, 3, 1, False),   # rank 1; experts past one 16-expert relayout tile; H % 8 != 0
]


def _tuning(panels=16, grad_columns=256, rows=1024, block_rows=0, **fields):
    """Kernel settings (cpp/kernels/expert_ffn.h): the task shape, and any other KernelTuning field by name
    (``gemm`` a dict of GemmTuning fields)."""
    tuning = _ops.KernelTuning()
    tuning.panels_per_task, tuning.grad_columns_per_task, tuning.rows_per_task, tuning.block_rows = (
        panels, grad_columns, rows, block_rows)
    for name, value in fields.pop("gemm", {}).items():
        setattr(tuning.gemm, name, value)
    for name, value in fields.items():
        setattr(tuning, name, value)
    return tuning


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-E{c[1]}-H{c[2]}-I{c[3]}-k{c[4]}-r{c[5]}" for c in CASES])
def test_native_matches_reference(isa, case):
    _check_against_reference(isa, case)


def _check_against_reference(isa, case, tuning=None):
    tokens, experts, hidden, inter, top_k, rank, skew = case
    weights, x, index, w, gate_up, down = _problem(tokens, experts, hidden, inter, top_k, rank, seed=tokens,
                                                   skew=skew)
    native = NativeExperts(isa, tuning=tuning)
    out, saved = native.forward(weights, x, index, w, gate_up, down)
    expected = reference.autograd(weights, x.float(), index, w, gate_up, down)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, hidden)
    if tokens == 0:
        return
    assert rel_err(out, expected) <= 2e-2

    grad_out = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    ref_out, ref_saved = reference.forward(weights, x, index, w, gate_up, down)
    ref_grads = reference.backward(weights, ref_saved, grad_out, gate_up, down)
    grads = native.backward(weights, saved, grad_out, gate_up, down)
    assert rel_err(grads[0], ref_grads[0]) <= 2e-2
    assert rel_err(grads[1], ref_grads[1]) <= 2e-2
    if rank:
        for got, want in zip(vars(grads[2]).values(), vars(ref_grads[2]).values()):
            assert rel_err(got, want) <= 2e-2


@pytest.mark.parametrize("isa", ISAS)
# one panel; odd widths; wider than the layer; the hot expert (130 rows) split over 16- and 40-row tasks
# (AMX blocks of fewer than 32 rows inside a split); every expert in one task; product calls of 7, 32 and 50 rows
# inside a task (a ragged last block each). H = 100: the gate/up input gradient's compact tiles are ragged past
# the first column block.
@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (16, 512), (2, 32, 16), (8, 256, 40), (8, 256, 4096),
                                   (8, 256, 1024, 7), (3, 48, 100, 32), (8, 256, 4096, 50)])
def test_native_matches_reference_at_other_task_widths(isa, shape):
    _check_against_reference(isa, (130, 5, 100, 40, 2, 4, True), _tuning(*shape))


def test_kernel_tuning_defaults_and_refusals():
    """A fresh KernelTuning holds the built-in settings (expert_ffn.h, panel_gemm.h); settings out of range are
    refused with the field's name, by check() and by the kernels before they run."""
    tuning = _ops.KernelTuning()
    assert (tuning.panels_per_task, tuning.grad_columns_per_task, tuning.rows_per_task, tuning.block_rows) == (
        16, 256, 1024, 0)
    assert (tuning.streaming_copies, tuning.streaming_outputs) == (True, 13)
    assert (tuning.gemm.pack_prefetch_rows, tuning.gemm.pack_prefetch_l2, tuning.gemm.amx_prefetch_next) == (
        8, True, True)
    tuning.check()
    bad = [({"panels": 0}, "panels_per_task"), ({"grad_columns": 0}, "grad_columns_per_task"),
           ({"grad_columns": 100}, "grad_columns_per_task"), ({"rows": 0}, "rows_per_task"),
           ({"rows": -2}, "rows_per_task"), ({"rows": 1 << 31}, "rows_per_task"),
           ({"block_rows": -1}, "block_rows"), ({"block_rows": 1 << 31}, "block_rows"),
           ({"streaming_outputs": 16}, "streaming_outputs"), ({"streaming_outputs": -1}, "streaming_outputs"),
           ({"gemm": {"pack_prefetch_rows": -1}}, "gemm.pack_prefetch_rows"),
           ({"gemm": {"pack_prefetch_rows": 4097}}, "gemm.pack_prefetch_rows")]
    weights, x, index, w, gate_up, down = _problem(4, 4, 32, 16, 2, 2, seed=0)
    for fields, name in bad:
        with pytest.raises(ValueError, match=f"kernel tuning: {name}"):
            _tuning(**fields).check()
        with pytest.raises(ValueError, match=f"kernel tuning: {name}"):
            NativeExperts("portable", tuning=_tuning(**fields)).forward(weights, x, index, w, gate_up, down)


def test_isa_variants_agree_closely():
    if len(ISAS) < 2:
        pytest.skip(f"this CPU runs only {ISAS}")
    weights, x, index, w, gate_up, down = _problem(50, 6, 64, 48, 2, 4, seed=3)
    outs = [NativeExperts(isa).forward(weights, x, index, w, gate_up, down)[0] for isa in ISAS]
    for other in outs[1:]:
        assert rel_err(other, outs[0]) <= 1e-2


def test_unsupported_isa_and_layout_are_named():
    with pytest.raises(ValueError, match="unknown ISA"):
        NativeExperts("sse2")
    if "amx" not in ISAS:
        with pytest.raises(ValueError, match="AMX"):
            NativeExperts("amx")
    weights, x, index, w, gate_up, down = _problem(4, 4, 32, 16, 2, 0, seed=0)
    weights.gate_up = weights.gate_up.float()
    with pytest.raises(Exception, match="MOECC_BACKEND=reference"):
        NativeExperts("portable").forward(weights, x, index, w, None, None)


def test_packing_layout():
    weights = torch.arange(2 * 20 * 40, dtype=torch.float32).reshape(2, 20, 40).bfloat16()
    packed = _ops.pack_experts(weights)
    per_expert = 32 * 64  # rows padded to 32, cols to 64
    assert packed.numel() == 2 * per_expert
    n, k = 17, 33  # element W[1][17][33]: panel 1, pair row 16, lane 1, odd
    offset = per_expert + 16 * 64 + (k // 2) * 32 + (n % 16) * 2 + 1
    assert packed[offset] == weights[1, n, k]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(20, 40), (16, 32), (33, 70), (1, 1), (48, 2048)])
def test_each_isa_packs_weight_slices_exactly_like_the_reference_packer(isa, shape):
    rows, cols = shape
    matrix = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)).bfloat16()
    expected = _ops.pack_experts(matrix[None])
    panels = -(-rows // 16)
    panel_size = 16 * (-(-cols // 32) * 32)
    assert torch.equal(_ops.pack_rows(isa, matrix, 0, panels), expected)
    if panels > 1:  # a slice starting at a later panel, as a product task packs it
        assert torch.equal(_ops.pack_rows(isa, matrix, 1, panels), expected[panel_size:])
    with pytest.raises(ValueError, match="out of range"):
        _ops.pack_rows(isa, matrix, 0, panels + 1)


@pytest.mark.parametrize("isa", ISAS)
def test_native_backend_through_prepare_matches_hf_peft_in_bf16(isa):
    import copy

    from peft import get_peft_model

    import moecc
    from moecc.tiny_models import tiny_model

    from ..parity import lora_config, randomize_lora

    base = tiny_model("qwen3_moe", dtype=torch.bfloat16, seed=2)
    reference = get_peft_model(copy.deepcopy(base), lora_config("qwen3_moe"))
    randomize_lora(reference, 5)
    engine = moecc.prepare(copy.deepcopy(base), lora_config=lora_config("qwen3_moe"), device="cpu",
                           config=moecc.MoeccConfig(backend="native", isa=isa))
    engine.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    a = reference(input_ids=ids, labels=ids)
    b = engine(input_ids=ids, labels=ids)
    assert abs(a.loss.item() - b.loss.item()) <= 2e-2 * a.loss.item()
    b.loss.backward()
    assert all(p.grad is not None for n, p in engine.named_parameters() if p.requires_grad and ".experts." in n)


def test_native_follows_merge_adapter():
    import copy

    from peft import get_peft_model

    import moecc
    from moecc.tiny_models import tiny_model

    from ..parity import lora_config, randomize_lora

    base = tiny_model("qwen3_moe", dtype=torch.bfloat16, seed=4)
    reference = get_peft_model(copy.deepcopy(base), lora_config("qwen3_moe"))
    randomize_lora(reference, 6)
    engine = moecc.prepare(copy.deepcopy(base), lora_config=lora_config("qwen3_moe"), device="cpu",
                           config=moecc.MoeccConfig(backend="native", isa=ISAS[-1]))
    engine.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for step in ("before", "merged", "unmerged"):
            if step == "merged":
                reference.merge_adapter(), engine.merge_adapter()
            elif step == "unmerged":
                reference.unmerge_adapter(), engine.unmerge_adapter()
            assert rel_err(engine(input_ids=ids).logits, reference(input_ids=ids).logits) <= 5e-2, step


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_token_rows_in_and_out_equal_float32_rows_rounded(isa):
    """The kernels read the output gradient and write the output and input gradient in bf16 (a bf16 model's
    path: no float32 copies around the call) exactly as the float32 path's results rounded to nearest even."""
    weights, x, index, w, gate_up, down = _problem(130, 5, 96, 40, 2, 4, seed=5, skew=True)
    shape = (5, 96, 40)
    matrices = (weights.gate_up, weights.down)
    offsets, order = _ops.group_tokens_by_expert(index, 5)
    routing = w.reshape(-1).contiguous()
    factors = [None if lora is None else (lora.A.reshape(5, 4, -1).contiguous(), lora.B, lora.scaling)
               for lora in (gate_up, down)]
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        hidden_copy = torch.full_like(x, float("nan"))
        out, saved_gate_up = _ops.expert_ffn_forward(isa, matrices, shape, 2, x, offsets, order, routing, *factors,
                                                     out=torch.empty(130, 96, dtype=dtype), hidden_copy=hidden_copy)
        assert torch.equal(hidden_copy, x)  # every token's row, once (the copy a caller saves for backward)
        grad_out = torch.randn(130, 96, generator=torch.Generator().manual_seed(2)).bfloat16().to(dtype)
        grads = _ops.expert_ffn_backward(isa, matrices, shape, 2, x, offsets, order, routing, *factors,
                                         saved_gate_up, grad_out, grad_hidden=torch.empty(130, 96, dtype=dtype))
        results[dtype] = (out, *grads)
    wide, narrow = results[torch.float32], results[torch.bfloat16]
    assert narrow[0].dtype == narrow[1].dtype == torch.bfloat16
    assert torch.equal(narrow[0], wide[0].bfloat16())
    assert torch.equal(narrow[1], wide[1].bfloat16())
    assert torch.equal(narrow[2], wide[2])  # routing-weight gradients
    for got, want in zip(narrow[3] + narrow[4], wide[3] + wide[4]):  # LoRA gradients
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="hidden_copy must not share memory"):
        _ops.expert_ffn_forward(isa, matrices, shape, 2, x, offsets, order, routing, *factors, hidden_copy=x)
    with pytest.raises(ValueError, match="out must be float32 or bfloat16"):
        _ops.expert_ffn_forward(isa, matrices, shape, 2, x, offsets, order, routing, *factors,
                                out=torch.empty(130, 96, dtype=torch.float16))


@pytest.mark.parametrize("isa", ISAS)
def test_prepacked_weights_give_the_same_forward(isa):
    """The prepack experiment: forward products reading a packed copy of the weights equal those packing their
    slice per task, bit for bit (one layout, one product); the copy is made once and again after a merge."""
    import types

    weights, x, index, w, gate_up, down = _problem(130, 5, 96, 40, 2, 4, seed=7, skew=True)
    weights.cache_owner = types.SimpleNamespace()
    expected, _ = NativeExperts(isa).forward(weights, x, index, w, gate_up, down)
    prepacked = NativeExperts(isa, prepack=True)
    out, _ = prepacked.forward(weights, x, index, w, gate_up, down)
    assert torch.equal(out, expected)
    packed = weights.cache_owner._moecc_packed[1]
    prepacked.forward(weights, x, index, w, gate_up, down)
    assert weights.cache_owner._moecc_packed[1] is packed  # kept
    weights.revision = (("gate_up_proj", ("default",)),)  # PEFT merged into the weights: packed again
    prepacked.forward(weights, x, index, w, gate_up, down)
    assert weights.cache_owner._moecc_packed[1] is not packed


def test_kernel_inputs_are_checked_before_crossing():
    weights, x, index, w, gate_up, down = _problem(4, 4, 32, 16, 2, 2, seed=0)
    packed = (weights.gate_up, weights.down)  # the kernels read the model's own weights
    offsets, order = _ops.group_tokens_by_expert(index, 4)
    routing = w.reshape(-1).contiguous()
    bad_offsets = offsets.clone()
    bad_offsets[-1] = 1000
    with pytest.raises(ValueError, match="offsets must rise"):
        _ops.expert_ffn_forward("portable", packed, (4, 32, 16), 2, x, bad_offsets, order, routing, None, None)
    bad_order = order.clone()
    bad_order[0] = bad_order[1]
    with pytest.raises(ValueError, match="permutation"):
        _ops.expert_ffn_forward("portable", packed, (4, 32, 16), 2, x, offsets, bad_order, routing, None, None)
    with pytest.raises(ValueError, match="order has 8 elements, expected 6"):
        _ops.expert_ffn_forward("portable", packed, (4, 32, 16), 2, x[:3], offsets, order, routing, None, None)
    a = gate_up.A.reshape(4, 2, 32).contiguous()
    b_transposed = gate_up.B.t().contiguous()  # [r*E, out], not PEFT's [out, r*E]
    with pytest.raises(ValueError, match="B \\[32, r\\*4\\]"):
        _ops.expert_ffn_forward("portable", packed, (4, 32, 16), 2, x, offsets, order, routing, (a, b_transposed, 1.0),
                                None)
    with pytest.raises(ValueError, match="gate_up weights must be \\[4, 32, 32\\]"):
        _ops.expert_ffn_forward("portable", (weights.gate_up[:, :16].contiguous(), weights.down), (4, 32, 16), 2, x,
                                offsets, order, routing, None, None)
    with pytest.raises(ValueError, match="must be contiguous"):
        _ops.expert_ffn_forward("portable", (weights.gate_up.transpose(1, 2), weights.down), (4, 32, 16), 2, x,
                                offsets, order, routing, None, None)


def test_reused_buffers_never_alias_live_results():
    """Two layers in flight (forward, forward, backward, backward), twice: pooled buffers come back between
    steps, and every result equals a fresh backend's."""
    problems = [_problem(40, 6, 64, 32, 2, 4, seed) for seed in (11, 12)]
    pooled = NativeExperts(ISAS[-1])
    for _ in range(2):
        outputs, saved = [], []
        for weights, x, index, w, gu, down in problems:
            out, state = pooled.forward(weights, x, index, w, gu, down)
            outputs.append(out)
            saved.append(state)
        grads = [pooled.backward(p[0], s, torch.ones_like(o), p[4], p[5]) for p, s, o in zip(problems, saved, outputs)]
        for (weights, x, index, w, gu, down), out, (grad_hidden, grad_w, _) in zip(problems, outputs, grads):
            fresh = NativeExperts(ISAS[-1])
            expected, state = fresh.forward(weights, x, index, w, gu, down)
            expected_grad, expected_grad_w, _ = fresh.backward(weights, state, torch.ones_like(expected), gu, down)
            assert torch.equal(out, expected)
            assert torch.equal(grad_hidden, expected_grad)
            assert torch.equal(grad_w, expected_grad_w)


def test_second_backward_of_one_forward_is_refused_not_a_crash():
    weights, x, index, w, gu, down = _problem(20, 4, 32, 16, 2, 4, 3)
    native = NativeExperts(ISAS[-1])
    out, saved = native.forward(weights, x, index, w, gu, down)
    native.backward(weights, saved, torch.ones_like(out), gu, down)
    with pytest.raises(RuntimeError, match="already used by a backward"):
        native.backward(weights, saved, torch.ones_like(out), gu, down)
    with pytest.raises(ValueError, match="gate_up_out is missing"):  # straight to the kernel: no null pointer
        _ops.expert_ffn_backward(native.isa, (weights.gate_up, weights.down), (4, 32, 16), 2, x, saved.offsets,
                                 saved.order, saved.top_k_weights.reshape(-1), None, None, None,
                                 torch.ones(20, 32))


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_experts_are_held_once_in_host_memory():
    """The kernels read the model's weights in place: a training step adds scratch, not a copy of the experts
    (the issue's bound: host memory for expert weights at most 1.05x their bf16 size)."""
    experts, hidden, inter, tokens = 32, 2048, 1024, 64
    g = torch.Generator().manual_seed(0)
    weights = ExpertWeights((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).bfloat16(),
                            (torch.randn(experts, hidden, inter, generator=g) * 0.02).bfloat16())
    weight_bytes = weights.gate_up.nbytes + weights.down.nbytes  # 402 MB
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    index = torch.rand(tokens, experts, generator=g).topk(4, dim=1).indices
    w = torch.rand(tokens, 4, generator=g)
    native = NativeExperts(ISAS[-1])
    before = _resident_bytes()  # the weights are written, so resident, already
    for _ in range(3):  # scratch and pools fill on the first step; nothing grows after
        out, saved = native.forward(weights, x, index, w, None, None)
        native.backward(weights, saved, torch.ones_like(out, dtype=torch.float32), None, None)
    growth = _resident_bytes() - before
    # Per-process scratch (per-thread packing buffers, the pool, torch's own first-use state) is a few tens of
    # MB whatever the model; a copy of the experts would be another 402 MB.
    scratch_allowance = 48e6
    assert growth < 0.05 * weight_bytes + scratch_allowance, (
        f"{growth / 1e6:.0f} MB more resident for {weight_bytes / 1e6:.0f} MB of experts")


def test_buffer_pool_hands_out_the_smallest_fitting_buffer_once():
    from moecc.experts.native import _BufferPool

    pool = _BufferPool()
    lent = [pool.take((n,), torch.bfloat16) for n in (100, 10, 50)]
    buffers = [tensor._base for tensor in lent]
    for tensor in lent:
        pool.give(tensor)
    pool.give(lent[0])  # again: ignored, or the 100 would be handed out twice below
    pool.give(torch.zeros(60, dtype=torch.bfloat16))  # not the pool's: ignored
    taken = pool.take((4, 10), torch.bfloat16)  # 40 elements: the 50-element buffer, not the first or largest
    assert taken.shape == (4, 10) and taken._base is buffers[2]
    again = pool.take((4, 10), torch.bfloat16)  # the 50 is out now: the 100 is next
    assert again._base is buffers[0]
    fresh = pool.take((4, 10), torch.bfloat16)  # only the 10 is left, too small: dropped, a new one made
    assert all(fresh._base is not b for b in buffers) and pool.take((1,), torch.float32).numel() == 1


def test_buffer_pool_counts_the_bytes_of_new_buffers_only():
    from moecc.experts.native import _BufferPool

    pool = _BufferPool()
    first = pool.take((10, 4), torch.float32)
    assert pool.fresh_bytes == 160
    pool.give(first)
    pool.take((5, 4), torch.float32)  # fits the one given back: nothing new
    assert pool.fresh_bytes == 160
    pool.take((3,), torch.bfloat16)  # none free: a new one
    assert pool.fresh_bytes == 166


def test_prepack_weights_packs_in_prepare_and_trains_the_same(monkeypatch):
    """MoeccConfig.prepack_weights: prepare packs every native layer (checking host memory first), and a
    training step gives the same loss and gradients as packing per task."""
    import copy

    import moecc
    from moecc.experts import native as native_experts
    from moecc.tiny_models import tiny_model

    from ..parity import batches, lora_config, randomize_lora

    base = tiny_model("qwen3_moe", dtype=torch.bfloat16, seed=0)
    models = []
    for prepack in (False, True):
        model = moecc.prepare(copy.deepcopy(base), lora_config=lora_config("qwen3_moe"), device="cpu",
                              config=moecc.MoeccConfig(backend="native", prepack_weights=prepack))
        randomize_lora(model, 3)
        models.append(model)
    assert all(hasattr(layer.experts, "_moecc_packed") for layer in models[1].moecc.layers)
    assert not any(hasattr(layer.experts, "_moecc_packed") for layer in models[0].moecc.layers)
    (ids, mask, labels), = batches(models[0].config.vocab_size, 1, seed=2)
    losses = [m(input_ids=ids, attention_mask=mask, labels=labels).loss for m in models]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name

    # merge, unmerge, new LoRA values, merge again: the merged-adapter list is as before, the weights are not
    with torch.no_grad():
        for merge_again in (False, True):
            logits = []
            for model in models:
                model.merge_adapter()
                first = model(input_ids=ids, attention_mask=mask).logits
                model.unmerge_adapter()
                if merge_again:
                    randomize_lora(model, 7)
                    model.merge_adapter()
                logits.append(model(input_ids=ids, attention_mask=mask).logits)
                if merge_again:
                    model.unmerge_adapter()
                assert first is not None
            assert torch.equal(logits[0], logits[1])

    monkeypatch.setattr(native_experts, "_available_host_bytes", lambda: 1000)
    with pytest.raises(moecc.MoeccError, match="prepack_weights needs .* GB of host memory"):
        moecc.prepare(copy.deepcopy(base), lora_config=lora_config("qwen3_moe"), device="cpu",
                      config=moecc.MoeccConfig(backend="native", prepack_weights=True))
    monkeypatch.setenv("MOECC_PREPACK_WEIGHTS", "yes")
    assert moecc.MoeccConfig.from_env().prepack_weights


def _backward_with_kept_and_recomputed_inner(isa, problem, seed, tuning=None):
    """Backward results (input and routing gradients, the four factor gradients) of one problem (_problem's
    tokens, experts, hidden, inter, top_k, rank), first with the LoRA inner products the forward kept, then with
    them dropped so the kernel recomputes them."""
    weights, x, index, w, gate_up, down = _problem(*problem, seed=seed, skew=True)
    grad_out = torch.randn(problem[0], problem[2], generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    native = NativeExperts(isa, tuning=tuning)
    results = []
    for keep in (True, False):
        _, saved = native.forward(weights, x, index, w, gate_up, down)
        assert all(t is not None and t.shape == (problem[0] * problem[4], problem[5]) for t in saved.lora_inner)
        if not keep:
            saved.lora_inner = None  # the kernel recomputes them
        grad_hidden, grad_weights, grads = native.backward(weights, saved, grad_out, gate_up, down)
        results.append([grad_hidden, grad_weights, grads.gate_up_A, grads.gate_up_B, grads.down_A, grads.down_B])
    return results


@pytest.mark.parametrize("isa", ISAS)
def test_backward_reuses_the_forwards_lora_inner_products_bit_for_bit(isa):
    """The LoRA inner products the forward keeps give the backward exactly what recomputing them gives."""
    results = _backward_with_kept_and_recomputed_inner(isa, (130, 5, 96, 24, 2, 8), seed=3)
    for kept, recomputed in zip(*results):
        assert torch.equal(kept, recomputed)
    weights, x, index, w, gate_up, down = _problem(130, 5, 96, 24, 2, 8, seed=3, skew=True)
    grad_out = torch.randn(130, 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    native = NativeExperts(isa)
    # and they are really read: zeroed, the B gradients (s sum (x A) dG, s sum w (act A) dy) come out zero
    _, saved = native.forward(weights, x, index, w, gate_up, down)
    for inner in saved.lora_inner:
        inner.zero_()
    _, _, grads = native.backward(weights, saved, grad_out, gate_up, down)
    assert not grads.gate_up_B.any() and not grads.down_B.any()
    assert results[0][3].any() and results[0][5].any()


def test_lora_inner_products_are_refused_for_a_projection_without_lora():
    weights, x, index, w, gate_up, _ = _problem(16, 4, 32, 16, 2, 4, seed=5)
    offsets, order = _ops.group_tokens_by_expert(index, 4)
    lora = (gate_up.A.view(4, 4, -1), gate_up.B, gate_up.scaling)
    with pytest.raises(ValueError, match="without LoRA"):
        _ops.expert_ffn_forward(_ops.best_isa(), (weights.gate_up, weights.down), (4, 32, 16), 2, x.bfloat16(),
                                offsets, order, w.float().reshape(-1).contiguous(), lora, None,
                                lora_inner=(torch.zeros(32, 4), torch.zeros(32, 4)))
    with pytest.raises(ValueError, match="inner_gate_up has 16 elements"):
        _ops.expert_ffn_forward(_ops.best_isa(), (weights.gate_up, weights.down), (4, 32, 16), 2, x.bfloat16(),
                                offsets, order, w.float().reshape(-1).contiguous(), lora, None,
                                lora_inner=(torch.zeros(16), None))


@pytest.mark.amx
@pytest.mark.parametrize("prefetch_next", [True, False], ids=["next-block-prefetch", "none"])
def test_amx_matches_reference_with_and_without_the_next_block_prefetch(prefetch_next):
    """K not a multiple of a tile's 32 (H = 300, 2I = 400) and token blocks past one 32-row block (200 rows, a
    hot expert), with and without the next block's A rows prefetched: the AMX kernels agree with the reference,
    and the prefetch changes no bit."""
    if "amx" not in ISAS:
        pytest.skip("needs a CPU with AMX (and the kernel's permission to use its tile data)")
    weights, x, index, w, gate_up, down = _problem(200, 6, 300, 200, 2, 4, seed=9, skew=True)
    native = NativeExperts("amx", tuning=_tuning(gemm={"amx_prefetch_next": prefetch_next}))
    out, saved = native.forward(weights, x, index, w, gate_up, down)
    grad_out = torch.randn(200, 300, generator=torch.Generator().manual_seed(2))
    grads = native.backward(weights, saved, grad_out, gate_up, down)
    default_out, default_saved = NativeExperts("amx").forward(weights, x, index, w, gate_up, down)
    assert torch.equal(out, default_out)
    assert rel_err(out, reference.autograd(weights, x.float(), index, w, gate_up, down)) <= 2e-2
    _, ref_saved = reference.forward(weights, x, index, w, gate_up, down)
    ref_grads = reference.backward(weights, ref_saved, grad_out, gate_up, down)
    assert rel_err(grads[0], ref_grads[0]) <= 2e-2 and rel_err(grads[1], ref_grads[1]) <= 2e-2
    for got, want in zip(vars(grads[2]).values(), vars(ref_grads[2]).values()):
        assert rel_err(got, want) <= 2e-2


def test_released_results_are_reused_and_never_handed_out_twice():
    """bf16 outputs and input gradients given back through release_result come back from later calls (same pages)
    with correct values; one released twice still goes to one caller at a time; tensors it did not hand out are
    not pooled."""
    weights, x, index, w, gate_up, down = _problem(40, 5, 64, 32, 2, 4, seed=3)
    native = NativeExperts(_ops.best_isa())
    want, saved = native.forward(weights, x, index, w, gate_up, down)
    grad_out = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    want_grad = native.backward(weights, saved, grad_out, gate_up, down)[0]
    first = want.clone()
    native.release_result(want)
    native.release_result(want)  # twice: must not come back for two live results
    again, saved = native.forward(weights, x, index, w, gate_up, down)
    assert again.data_ptr() == want.data_ptr() and torch.equal(again, first)
    other, saved_other = native.forward(weights, x, index, w, gate_up, down)
    assert other.data_ptr() != again.data_ptr() and torch.equal(other, first)
    native.release(saved_other)
    grad = native.backward(weights, saved, grad_out, gate_up, down)[0]
    _, saved = native.forward(weights, x, index, w, gate_up, down)  # before the release: it would take the pages
    native.release_result(grad)
    grad_again = native.backward(weights, saved, grad_out, gate_up, down)[0]
    assert grad_again.data_ptr() == grad.data_ptr() and torch.equal(grad_again, want_grad)
    native.release_result(torch.zeros(40, 64))  # float32: not the pool's
    native.release_result(torch.zeros(40, 64, dtype=torch.bfloat16))  # bf16, but not handed out by it
    assert native._results._free == []


def test_a_result_released_again_after_it_was_lent_again_is_ignored():
    """release(a), a later call lends the same pages as b, release(a) again: the next call must not get b's pages
    while b is live."""
    weights, x, index, w, gate_up, down = _problem(40, 5, 64, 32, 2, 4, seed=3)
    native = NativeExperts(_ops.best_isa())
    a, saved = native.forward(weights, x, index, w, gate_up, down)
    native.release(saved)
    native.release_result(a)
    b, saved = native.forward(weights, x, index, w, gate_up, down)
    native.release(saved)
    assert b.data_ptr() == a.data_ptr()
    native.release_result(a)  # stale: b holds these pages now
    c, _ = native.forward(weights, x, index, w, gate_up, down)
    assert c.data_ptr() != b.data_ptr()


def _lora_grads(native, problem, mask=None, seed=1):
    """One forward and backward on ``native``: its LoraGrads' four tensors, as it returned them."""
    weights, x, index, w, gate_up, down = problem
    out, saved = native.forward(weights, x, index, w, gate_up, down, expert_mask=mask)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return list(vars(native.backward(weights, saved, grad_out, gate_up, down)[2]).values())


def _subset_mask(experts, chosen):
    mask = torch.zeros(experts, dtype=torch.bool)
    mask[list(chosen)] = True
    return mask


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("subset", [None, (1, 3)], ids=["all-experts", "subset"])
def test_released_lora_grads_are_reused_zeroed_and_bit_exact(isa, subset):
    """LoRA gradients given back through release_result (the LoraGrads fields themselves) come back from the next
    backward (same pages), with the values a fresh backend gives: a first call routed to every expert leaves
    stale A and B rows in them, which a subset's call must not show."""
    problem = _problem(40, 6, 64, 32, 2, 4, seed=3)
    mask = None if subset is None else _subset_mask(6, subset)
    native = NativeExperts(isa)
    first = _lora_grads(native, _problem(40, 6, 64, 32, 2, 4, seed=4), seed=2)  # other routing and gradients
    for grad in first:
        native.release_result(grad)
    again = _lora_grads(native, problem, mask)
    assert [g.data_ptr() for g in again] == [g.data_ptr() for g in first]
    expected = _lora_grads(NativeExperts(isa), problem, mask)
    for got, want in zip(again, expected):
        assert torch.equal(got, want)
    if subset is not None:  # every other expert's blocks are zero: A rows [e*r, (e+1)*r), B columns j*E + e
        others = [e for e in range(6) if e not in subset]
        assert not again[0].view(6, 4, -1)[others].any() and not again[1].view(-1, 4, 6)[:, :, others].any()


def test_lora_grads_not_released_are_never_reused():
    """A backward's LoRA gradients the caller keeps (co-compute hands them to autograd) keep their values through
    later calls; once dropped, the pool does not hold them (it never had them back)."""
    native = NativeExperts(_ops.best_isa())
    kept = _lora_grads(native, _problem(40, 6, 64, 32, 2, 4, seed=3))
    values = [g.clone() for g in kept]
    later = _lora_grads(native, _problem(40, 6, 64, 32, 2, 4, seed=4), _subset_mask(6, (0, 5)), seed=2)
    assert not {g.data_ptr() for g in kept} & {g.data_ptr() for g in later}
    assert all(torch.equal(grad, value) for grad, value in zip(kept, values))
    for _ in range(3):
        _lora_grads(native, _problem(40, 6, 64, 32, 2, 4, seed=4))
    del kept, later
    assert len(native._results._lent) == 0 and native._results._free == []


def _kernel_problem():
    """A 4-expert problem's forward through the kernels, for calling their backward directly: (matrices, shape,
    x, offsets, order, routing, factors, gate_up_out, grad_out)."""
    weights, x, index, w, gate_up, down = _problem(20, 4, 32, 16, 2, 2, seed=0)
    matrices, shape = (weights.gate_up, weights.down), (4, 32, 16)
    offsets, order = _ops.group_tokens_by_expert(index, 4)
    routing = w.reshape(-1).contiguous()
    factors = [(lora.A.reshape(4, 2, -1).contiguous(), lora.B, lora.scaling) for lora in (gate_up, down)]
    _, gate_up_out = _ops.expert_ffn_forward("portable", matrices, shape, 2, x, offsets, order, routing, *factors)
    grad_out = torch.randn(20, 32, generator=torch.Generator().manual_seed(1))
    return matrices, shape, x, offsets, order, routing, factors, gate_up_out, grad_out


def test_kernel_lora_grad_outputs_are_checked_and_a_is_zeroed():
    """lora_grads passed to the kernels: written in place, A zeroed first (NaN-filled buffers give the values of
    fresh ones), and refused with the tensor's name when they cannot take the result."""
    matrices, shape, x, offsets, order, routing, factors, gate_up_out, grad_out = _kernel_problem()

    def backward(lora_grads, lora=factors):
        return _ops.expert_ffn_backward("portable", matrices, shape, 2, x, offsets, order, routing, *lora,
                                        gate_up_out, grad_out, lora_grads=lora_grads)[2:]

    fresh = backward(None)
    given = [tuple(torch.full_like(g, float("nan")) for g in pair) for pair in fresh]
    written = backward(given)
    for got, buffer, want in zip(sum(written, ()), sum(given, ()), sum(fresh, ())):
        assert got is buffer and torch.equal(got, want)
    partly = backward([(None, given[0][1]), None])  # the others are made here
    assert partly[0][1] is given[0][1] and torch.equal(partly[1][0], fresh[1][0])
    a_gu, b_gu = fresh[0]
    bad = [((a_gu.double(), b_gu), "gate_up LoRA A gradient must be a contiguous CPU torch.float32"),
           ((a_gu, b_gu[:, :4]), r"gate_up LoRA B gradient .* shape \[32, 8\], got torch.float32 \[32, 4\]"),
           ((a_gu.transpose(0, 1).contiguous().transpose(0, 1), b_gu), "gate_up LoRA A gradient must be a contiguous")]
    for pair, message in bad:
        with pytest.raises(ValueError, match=message):
            backward([pair, None])
    with pytest.raises(ValueError, match="must not share memory"):
        backward([(a_gu, b_gu), (fresh[1][0], b_gu)])
    factor = factors[0][0].clone()
    with pytest.raises(ValueError, match="must not share memory"):  # refused before A's gradient is zeroed
        backward([(factors[0][0], b_gu), None])
    assert torch.equal(factors[0][0], factor)
    with pytest.raises(ValueError, match="down LoRA gradient was given for a projection without LoRA"):
        backward([None, fresh[1]], [factors[0], None])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("columns", [256, 512])
def test_swiglu_backward_over_several_column_pieces(isa, columns):
    """I = 300: more than one 256-column piece of the fused SwiGLU backward and not a multiple of 16, in gradient
    tasks of 256 and 512 columns. It matches the reference, and the act rows it writes itself (the forward's LoRA
    inner products kept) give bit for bit what the rows of the separate activation pass give (dropped)."""
    tuning = _tuning(16, columns)
    _check_against_reference(isa, (130, 4, 64, 300, 2, 4, True), tuning)
    for kept, recomputed in zip(*_backward_with_kept_and_recomputed_inner(isa, (130, 4, 64, 300, 2, 4), seed=5,
                                                                          tuning=tuning)):
        assert torch.equal(kept, recomputed)


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "portable"])
@pytest.mark.parametrize("prefetch", [(0, 0), (16, 0), (4096, 1)], ids=["none", "16-into-L1", "past-the-matrix"])
def test_column_packing_prefetch_settings_keep_the_results(isa, prefetch):
    """The input gradients' column packing (AVX512 and AMX) with no prefetch, 16 rows ahead into L1, and more rows
    ahead than the matrix has (every request skipped) agrees with the reference."""
    rows_ahead, to_l2 = prefetch
    tuning = _tuning(gemm={"pack_prefetch_rows": rows_ahead, "pack_prefetch_l2": bool(to_l2)})
    _check_against_reference(isa, (130, 5, 100, 40, 2, 4, True), tuning)


def test_product_parts_name_every_product_phase_of_the_latest_call():
    from moecc import _C

    weights, x, index, w, gate_up, down = _problem(64, 4, 64, 48, 2, 4, seed=7)
    native = NativeExperts(_ops.best_isa())
    out, saved = native.forward(weights, x, index, w, gate_up, down)
    forward = _C.last_product_parts(False)
    assert [p[0] for p in forward] == ["gate_up", "down"]
    assert all(pack > 0 and gemm > 0 and epilogue > 0 for _, pack, gemm, epilogue in forward)
    native.backward(weights, saved, torch.randn(64, 64), gate_up, down)
    backward = _C.last_product_parts(True)
    assert [p[0] for p in backward] == ["down_input_grad", "gate_up_input_grad"]
    assert all(pack > 0 and gemm > 0 and epilogue > 0 for _, pack, gemm, epilogue in backward)
    assert _C.last_product_parts(False) == forward  # each list is the latest call of its own kind
    weights, x, index, w, gate_up, down = _problem(0, 4, 64, 48, 2, 4, seed=7)  # no tokens: no tasks, no time
    native.forward(weights, x, index, w, gate_up, down)
    assert [parts[1:] for parts in _C.last_product_parts(False)] == [(0.0, 0.0, 0.0), (0.0, 0.0, 0.0)]


def _bf16_rounding_inputs() -> torch.Tensor:
    """Floats over the whole exponent range, exact halfway cases (round to even), specials, float32 denormals."""
    import numpy as np

    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(4096) * np.exp2(rng.integers(-120, 120, 4096))).astype(np.float32)
    halfway = ((rng.integers(0, 1 << 16, 1024, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 1.2e-38,
                         np.finfo(np.float32).max, 1.0, 1.00390625, 1.01171875], dtype=np.float32)
    signalling = np.array([0x7F800001, 0xFF800001, 0x7FBFFFFF], dtype=np.uint32).view(np.float32)
    denormals = np.array([1e-39, -1e-39, 5.9e-39, 1e-45, -1e-45, 1.1e-38], dtype=np.float32)
    values = np.concatenate([spread, halfway, specials, signalling, denormals])
    values = np.concatenate([values, np.zeros(-len(values) % 16, dtype=np.float32)])
    return torch.from_numpy(values)


def _round_bf16(values: torch.Tensor, native: bool) -> torch.Tensor:
    from moecc import _C

    out = torch.empty(values.numel(), dtype=torch.int16)
    _C.testing.round_bf16(values.data_ptr(), out.data_ptr(), values.numel(), native)
    return out


def test_portable_bf16_rounding_matches_torch():
    values = _bf16_rounding_inputs()
    ours = _round_bf16(values, native=False)
    theirs = values.bfloat16().view(torch.int16)
    nan = values.isnan()
    assert torch.equal(ours[~nan], theirs[~nan])
    assert ours[nan].view(torch.bfloat16).isnan().all()


@pytest.mark.skipif(not __import__("moecc")._C.native_bf16(), reason="this CPU has no AVX512-BF16")
def test_native_bf16_rounding_matches_portable_but_flushes_denormals():
    values = _bf16_rounding_inputs()
    native, portable = _round_bf16(values, native=True), _round_bf16(values, native=False)
    denormal = (values != 0) & (values.abs() < torch.finfo(torch.float32).tiny)
    assert torch.equal(native[~denormal], portable[~denormal])  # NaNs too: both keep the payload's top, quieted
    flushed = native[denormal].view(torch.bfloat16).float()
    assert (flushed == 0).all() and torch.equal(flushed.signbit(), values[denormal].signbit())


def test_bf16_rounding_test_hook_refuses_ragged_lengths():
    with pytest.raises(ValueError, match="multiple of 16"):
        _round_bf16(torch.zeros(20), native=False)


def test_native_bf16_follows_cpu_and_environment():
    from moecc import _C
    from moecc.config import native_bf16_from_env

    wanted = _ops.cpu_features()["avx512_bf16"] and native_bf16_from_env()
    assert _C.native_bf16() == wanted


@pytest.mark.skipif(not __import__("moecc")._C.native_bf16(), reason="the portable rounding runs in every other test")
def test_layer_with_portable_bf16_rounding_matches_reference():
    """On an AVX512-BF16 CPU the epilogues round with its instruction; their integer-rounding builds (what other
    CPUs run) get the reference cases in a process with MOECC_NATIVE_BF16=0."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:cacheprovider", __file__,
         "-k", "test_native_matches_reference and not other_task_widths and not amx or follows_cpu_and_environment"],
        env=os.environ | {"MOECC_NATIVE_BF16": "0"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "deselected" in done.stdout


def _backward_results(isa, problem, seed, tuning=None):
    """Forward output and backward results (input and routing gradients, the four factor gradients) of one
    problem (_problem's tokens, experts, hidden, inter, top_k, rank; skewed routing)."""
    weights, x, index, w, gate_up, down = _problem(*problem, seed=seed, skew=True)
    grad_out = torch.randn(problem[0], problem[2], generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    native = NativeExperts(isa, tuning=tuning)
    out, saved = native.forward(weights, x, index, w, gate_up, down)
    grad_hidden, grad_weights, grads = native.backward(weights, saved, grad_out, gate_up, down)
    results = [out.clone(), grad_hidden, grad_weights]
    if gate_up is not None:
        results += [grads.gate_up_A, grads.gate_up_B, grads.down_A, grads.down_B]
    return results


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("problem", [(130, 5, 96, 32, 2, 8), (37, 6, 100, 40, 3, 4), (1, 4, 32, 16, 2, 0)],
                         ids=["H96", "H100", "one-token-no-lora"])
def test_streamed_rows_give_the_same_results(isa, problem):
    """Non-temporal stores (the grouped copies of hidden and output-gradient rows where the CPU has AVX512BW; the
    per-pair product rows, and optionally the gate/up output, the activation rows and the down input gradient's
    act and d gate / d up rows) give the same results bit for bit as plain stores: H a multiple of 32 and not (a
    row's last line partly padding; per-pair rows of 200 bytes, every other one not 16-byte aligned and so stored
    plainly), and match the reference. Before the streamed run a problem of another H leaves non-zero values where
    this one's row padding lies in the shared scratch, so a partial last line the streamed copies failed to zero
    (columns the products read, up to the padded K) would show."""
    plain = _backward_results(isa, problem, seed=9, tuning=_tuning(streaming_copies=False, streaming_outputs=0))
    every_output = _tuning(streaming_outputs=15)  # and the gate/up output
    _backward_results(isa, (60, 4, problem[2] + 24, problem[3] + 8, 2, 4), seed=2)  # dirties the scratch
    streamed = _backward_results(isa, problem, seed=9, tuning=every_output)
    if problem[5]:  # the backward's own activation pass (the forward's LoRA inner products dropped), streamed
        kept, recomputed = _backward_with_kept_and_recomputed_inner(isa, problem, seed=9, tuning=every_output)
        for a, b in zip(kept, recomputed):
            assert torch.equal(a, b)
    for a, b in zip(plain, streamed):
        assert torch.equal(a, b)
    assert torch.equal(_backward_results(isa, problem, seed=9)[1], streamed[1])  # the default mask, too
    _check_against_reference(isa, (*problem, False))


@pytest.mark.parametrize("op", ["combine_bf16", "combine_f32", "dots", "dots_bf16"])
@pytest.mark.parametrize("rank", [0, 1, 4, 7, 8, 12])
@pytest.mark.parametrize("n", [256, 40, 27], ids=["n256", "n40-tail8", "n27-tail11"])
def test_grouped_lora_rows_agree_with_one_call_a_row(op, rank, n):
    """The epilogues' grouped-row LoRA terms (up to 4 rows share each factor load) against the same functions
    called one row at a time and a float64 reference, over 1-11 rows (groups of 4 and a remainder), ranks 0-12
    and column tails: within float32 rounding (one bf16 step for bf16 outputs) of the reference, and nothing
    written past a row; the same bits as the per-row calls on whole 16-column vectors. That last needs the
    compiler to fuse the multiply-adds of both alike: GCC 13's FMA-chain heuristic did not (setup.py turns it
    off)."""
    from moecc import _C

    if op.startswith("dots") and rank == 0:
        rank = 2  # dots need a rank; rank 0 of the combines is rounding only
    g = torch.Generator().manual_seed(rank * 100 + n)
    for count in (1, 3, 4, 5, 11):
        ld, rows_ld, coef_ld = n + 9, n + 5, rank + 2  # factor, row and coefficient strides wider than needed
        coef = torch.randn(count * max(coef_ld, 1), generator=g)
        factors = torch.randn(max(rank, 1) * ld, generator=g)
        rows = torch.randn(count * rows_ld, generator=g)
        if op == "dots_bf16":
            rows = rows.bfloat16().view(torch.int16)
        # float64 reference: row r's first n columns, its coefficients and the rank-major factors
        x = (rows.view(torch.bfloat16) if op == "dots_bf16" else rows).double().view(count, rows_ld)[:, :n]
        k = coef.double().view(count, -1)[:, :rank] if rank else torch.zeros(count, 0, dtype=torch.float64)
        f = factors.double().view(-1, ld)[:rank, :n]
        expected = 1.25 * x @ f.T if op.startswith("dots") else x + (1.25 * k) @ f
        results = []
        for grouped in (False, True):
            r = rows.clone()
            # outputs start as a sentinel (1232.0, exact in bf16) that must survive in their padding
            if op == "combine_bf16":
                out, out_ld = torch.full((count * (n + 3),), 1232.0).bfloat16().view(torch.int16), n + 3
            elif op.startswith("dots"):
                out, out_ld = torch.full((count * (rank + 1),), 1232.0), rank + 1
            else:
                out, out_ld = torch.zeros(1), 0
            _C.testing.lora_rows(op, coef.data_ptr(), coef_ld, 1.25, factors.data_ptr(), ld, rank, n, r.data_ptr(),
                               rows_ld, out.data_ptr(), out_ld, count, grouped)
            if op == "combine_f32":  # in place: the columns past n untouched
                r = r.view(count, rows_ld)
                assert torch.equal(r[:, n:], rows.view(count, rows_ld)[:, n:])
                results.append(r[:, :n])
            elif op == "combine_bf16":
                written = out.view(torch.bfloat16).float().view(count, n + 3)
                assert (written[:, n:] == 1232.0).all()
                results.append(written[:, :n])
            else:  # every dot written, the padding not
                written = out.view(count, rank + 1)
                assert (written[:, :rank] != 1232.0).all() and (written[:, rank] == 1232.0).all()
                results.append(written[:, :rank])
        for result in results:
            if op == "combine_bf16":  # bf16 rounding (at most half a step: 2^-8 of the value) plus float32's
                assert ((result.double() - expected).abs() <= expected.abs() * 2.0**-8 * (1 + 1e-5) + 1e-5).all()
            else:
                assert rel_err(result, expected) < 1e-6
        per_row, grouped = results
        if n % 16 == 0:  # the same operations in the same order, fused alike (setup.py's FMA flag)
            assert torch.equal(per_row, grouped)
        elif op == "combine_bf16":
            assert ((grouped - per_row).abs() <= per_row.abs() * 2.0**-7).all()
        else:
            assert rel_err(grouped, per_row) < 1e-6


def _pairs_problem(isa, seed=5):
    """A 6-expert problem and the backward of its forward_pairs subset of experts 1, 3 and 4, as backward_pairs
    returns it: (problem, mask, grad_out, (rows, tokens, grad_weights, LoraGrads))."""
    problem = _problem(40, 6, 64, 32, 2, 4, seed=seed)
    weights, x, index, w, gate_up, down = problem
    mask = _subset_mask(6, (1, 3, 4))
    grad_out = torch.randn(40, 64, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    native = NativeExperts(isa)
    _, tokens, saved = native.forward_pairs(weights, x, index, w, gate_up, down, expert_mask=mask)
    assert tokens is not None  # rows per pair: what backward_pairs_into needs
    return problem, mask, grad_out, native.backward_pairs(weights, saved, grad_out, gate_up, down)


@pytest.mark.parametrize("isa", ISAS)
def test_backward_pairs_into_writes_backward_pairs_results_with_the_blocks_of_the_experts_named(isa):
    """The kernels write the rows, tokens and routing gradient backward_pairs returns, and of the LoRA gradients
    only the blocks of ``lora_experts``, in that order (here not sorted, and with expert 0, routed to but
    outside the subset, whose blocks are zero), into NaN-filled buffers, bit for bit."""
    problem, mask, grad_out, (rows, tokens, grad_w, grads) = _pairs_problem(isa)
    weights, x, index, w, gate_up, down = problem
    experts = torch.tensor([4, 0, 1, 3])
    full = list(vars(grads).values())
    lora = (gate_up, gate_up, down, down)
    blocks = tuple(torch.full((4, 4, g.shape[1]) if which % 2 == 0 else (g.shape[0], 4, 4), float("nan"))
                   for which, g in enumerate(full))
    out = PairGrads(torch.full(rows.shape, float("nan"), dtype=rows.dtype), torch.full(tokens.shape, -1),
                    torch.full(grad_w.shape, float("nan")), experts, blocks)
    native = NativeExperts(isa)
    _, _, saved = native.forward_pairs(weights, x, index, w, gate_up, down, expert_mask=mask)
    missing = PairGrads(out.rows, out.tokens, out.grad_weights, experts, (*blocks[:3], None))
    with pytest.raises(ValueError, match="the down projection has LoRA but no gradient blocks"):
        native.backward_pairs_into(weights, saved, grad_out, gate_up, down, out=missing)
    _, _, saved = native.forward_pairs(weights, x, index, w, gate_up, down, expert_mask=mask)
    assert native.backward_pairs_into(weights, saved, grad_out, gate_up, down, out=out) is None
    assert torch.equal(out.rows, rows) and torch.equal(out.tokens, tokens) and torch.equal(out.grad_weights, grad_w)
    for which, (block, grad) in enumerate(zip(blocks, full)):
        want = (grad.view(6, 4, -1)[experts] if which % 2 == 0 else grad.view(-1, 4, 6)[:, :, experts])
        assert torch.equal(block, want), which
        assert not block.select(0 if which % 2 == 0 else 2, 1).any() and lora[which].num_experts == 6


def test_lora_gradient_blocks_refuse_experts_they_cannot_hold():
    """lora_experts that leave out a routed expert, repeat one or name one past E are refused with what was
    wrong, before the kernels write anything."""
    matrices, shape, x, offsets, order, routing, factors, gate_up_out, grad_out = _kernel_problem()
    assert [e for e in range(4) if offsets[e + 1] > offsets[e]] == [0, 1, 2]  # expert 3 gets no pairs
    cases = [(torch.tensor([0, 1]), "routed expert 2 has block -1 of 2"),
             (torch.tensor([0, 1, 1, 3]), "distinct expert ids"), (torch.tensor([0, 1, 2, 4]), r"in \[0, 4\)"),
             (torch.tensor([0, 1, 2, 3], dtype=torch.int32), "1-D int64")]
    for experts, message in cases:
        with pytest.raises(ValueError, match=message):
            _ops.expert_ffn_backward("portable", matrices, shape, 2, x, offsets, order, routing, *factors,
                                     gate_up_out, grad_out, lora_experts=experts)
