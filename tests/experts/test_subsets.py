"""Every backend computes a subset of a layer's experts: over a partition of the experts the parts sum to the
full result. Per-pair and per-expert results (routing-weight and LoRA gradients) are disjoint, so for the
reference they sum to the full result bit for bit; so do the per-token sums (output, hidden-state gradient) of
tokens whose pairs all lie in one part, while a token split across parts is a float sum in another order, equal
to rounding. Grouped and native agree to rounding throughout."""
from __future__ import annotations

import pytest
import torch

from moecc import _ops
from moecc.experts import ExpertLora, ExpertWeights, group_by_expert, grouped, reference
from moecc.experts.native import NativeExperts, rows_pay
from moecc.experts.select import PerLayerExperts

from ..parity import rel_err

EXPERTS, HIDDEN, INTER, TOP_K, RANK = 8, 32, 16, 3, 2
GRAD_NAMES = ("gate_up_A", "gate_up_B", "down_A", "down_B")


def _weights(layout: str, dtype: torch.dtype, g: torch.Generator) -> ExpertWeights:
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2
    if layout == "default":
        return ExpertWeights(gate_up.to(dtype), down.to(dtype))
    # gpt-oss: transposed storage, interleaved gate/up, biases and a clamped activation
    return ExpertWeights(gate_up.transpose(1, 2).contiguous().to(dtype), down.transpose(1, 2).contiguous().to(dtype),
                         gate_up_bias=(torch.randn(EXPERTS, 2 * INTER, generator=g) * 0.1).to(dtype),
                         down_bias=(torch.randn(EXPERTS, HIDDEN, generator=g) * 0.1).to(dtype),
                         transposed=True, interleaved=True, swiglu_alpha=1.702, swiglu_limit=0.5)


def _problem(tokens: int, dtype: torch.dtype, seed: int = 0, layout: str = "default"):
    """Experts E-1 and E-2 get no pair, the others a few each; LoRA on both projections."""
    g = torch.Generator().manual_seed(seed)
    weights = _weights(layout, dtype, g)
    loras = [ExpertLora(torch.randn(RANK * EXPERTS, fan_in, generator=g) * 0.3,
                        torch.randn(fan_out, RANK * EXPERTS, generator=g) * 0.3, 0.7, EXPERTS)
             for fan_in, fan_out in ((HIDDEN, 2 * INTER), (INTER, HIDDEN))]
    index = torch.stack([torch.randperm(EXPERTS - 2, generator=g)[:TOP_K] for _ in range(tokens)]) \
        if tokens else torch.empty(0, TOP_K, dtype=torch.int64)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    w = torch.rand(tokens, TOP_K, generator=g)
    grad_out = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    return weights, x, index, w, loras, grad_out


def _partitions(seed: int) -> list[list[torch.Tensor]]:
    """Expert masks, each list a partition: all and nothing, halves, a random three-way split, one expert alone
    (an idle one, too)."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(0, 3, (EXPERTS,), generator=g)
    alone = torch.arange(EXPERTS) == 0
    idle = torch.arange(EXPERTS) == EXPERTS - 1
    halves = torch.arange(EXPERTS) % 2 == 0
    return [[torch.ones(EXPERTS, dtype=torch.bool), torch.zeros(EXPERTS, dtype=torch.bool)],
            [halves, ~halves], [part == i for i in range(3)], [alone, ~alone], [idle, ~idle]]


def _run(backend, problem, **subset):
    weights, x, index, w, loras, grad_out = problem
    out, saved = backend.forward(weights, x, index, w, *loras, **subset)
    grad_hidden, grad_w, grads = backend.backward(weights, saved, grad_out, *loras)
    return [out.float(), grad_hidden.float(), grad_w] + [getattr(grads, name) for name in GRAD_NAMES]


def _sum(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(values[1:], values[0].clone()) for values in zip(*parts)]


def _check_zeros_outside(results: list[torch.Tensor], mask: torch.Tensor, index: torch.Tensor) -> None:
    """Routing-weight gradients vanish on pairs outside ``mask``, LoRA gradients on experts outside it."""
    assert not results[2][~mask[index]].any()
    dropped = (~mask).nonzero().flatten().tolist()
    gate_up_a, gate_up_b, down_a, down_b = results[3:]
    for expert in dropped:
        for a in (gate_up_a, down_a):
            assert not a[expert * RANK:(expert + 1) * RANK].any()
        for b in (gate_up_b, down_b):
            assert not b[:, expert::EXPERTS].any()


def _native():
    return NativeExperts(_ops.best_isa())


@pytest.mark.parametrize("layout", ["default", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_reference_parts_sum_to_the_whole_bit_for_bit(dtype, tokens, layout):
    problem = _problem(tokens, dtype, layout=layout)
    index = problem[2]
    full = _run(reference, problem)
    for seed in range(3):
        for partition in _partitions(seed):
            parts = [_run(reference, problem, expert_mask=mask) for mask in partition]
            for mask, part in zip(partition, parts):
                _check_zeros_outside(part, mask, index)
            total = _sum(parts)
            for got, want in zip(total[2:], full[2:]):  # per pair, per expert: disjoint
                assert torch.equal(got, want)
            # tokens whose pairs lie in one part: the same sums, bit for bit; the others to rounding
            whole = torch.stack([mask[index].all(dim=1) for mask in partition]).any(dim=0)  # [T]
            for got, want in zip(total[:2], full[:2]):
                assert torch.equal(got[whole], want[whole])
                assert rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend,layout", [("grouped", "default"), ("grouped", "gpt_oss"), ("native", "default")])
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_fast_backends_parts_sum_to_the_whole(backend, layout, tokens):
    if backend == "grouped":
        dtype, module, tolerance = torch.float32, grouped, 1e-5
    else:
        dtype, tolerance = torch.bfloat16, 1e-2  # bf16 outputs round once per part
        module = _native()
    problem = _problem(tokens, dtype, seed=1, layout=layout)
    full = _run(module, problem)
    for partition in _partitions(4):
        parts = [_run(module, problem, expert_mask=mask) for mask in partition]
        for mask, part in zip(partition, parts):
            _check_zeros_outside(part, mask, problem[2])
        for got, want in zip(_sum(parts), full):
            assert rel_err(got, want) <= tolerance


@pytest.mark.parametrize("backend", ["reference", "grouped", "native"])
def test_a_grouping_selects_the_same_subset_as_a_mask(backend):
    module = {"reference": reference, "grouped": grouped}.get(backend) or _native()
    problem = _problem(9, torch.bfloat16, seed=2)
    mask = torch.arange(EXPERTS) % 3 == 1
    by_mask = _run(module, problem, expert_mask=mask)
    by_grouping = _run(module, problem, grouping=group_by_expert(problem[2], EXPERTS).subset(mask))
    for a, b in zip(by_mask, by_grouping):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not both"):
        module.forward(*problem[:4], *problem[4], expert_mask=mask, grouping=group_by_expert(problem[2], EXPERTS))


def test_empty_subset_computes_nothing():
    problem = _problem(5, torch.bfloat16, seed=3)
    for module in (reference, grouped, _native()):
        results = _run(module, problem, expert_mask=torch.zeros(EXPERTS, dtype=torch.bool))
        assert all(not r.any() for r in results)
        assert results[0].shape == (5, HIDDEN) and results[2].shape == (5, TOP_K)


@pytest.mark.parametrize("tokens", [0, 1, 13])
@pytest.mark.parametrize("backend", ["native", "per_layer"])
def test_native_pairs_are_the_subset_rows_before_their_sum(backend, tokens):
    """``forward_pairs`` / ``backward_pairs`` leave a subset's output and input gradient as rows per pair
    (float32 and bf16); summed at their tokens in float32 and rounded once, they are ``forward`` / ``backward``'s
    results bit for bit (the same sum), and the other results are the same tensors' values. All the pairs: dense,
    no rows."""
    native = _native()
    module = native if backend == "native" else PerLayerExperts(native)
    problem = _problem(tokens, torch.bfloat16, seed=3)
    weights, x, index, w, loras, grad_out = problem
    for partition in _partitions(5):
        for mask in partition:
            want = _run(module, problem, expert_mask=mask)
            rows, at, saved = module.forward_pairs(weights, x, index, w, *loras, expert_mask=mask)
            grad_rows, grad_at, grad_w, grads = module.backward_pairs(weights, saved, grad_out, *loras)
            pairs = int(mask[index].sum())
            if mask[index].all() or not rows_pay(pairs, tokens):  # every routed pair, or too many for rows
                assert at is None and grad_at is None and rows.shape == x.shape
                got = [rows.float(), grad_rows.float()]
            else:
                assert rows.dtype == torch.float32 and rows.shape == (pairs, HIDDEN) and at.shape == (pairs,)
                assert grad_rows.dtype == torch.bfloat16 and grad_rows.shape == (pairs, HIDDEN)
                got = [torch.zeros(x.shape).index_add_(0, t, r.float()).to(x.dtype).float()
                       for t, r in ((at, rows), (grad_at, grad_rows))]
            got += [grad_w] + [getattr(grads, name) for name in GRAD_NAMES]
            for a, b in zip(got, want):
                assert torch.equal(a, b)
            native.release_result(rows)
            native.release_result(grad_rows)


@pytest.mark.parametrize("backend", ["native", "per_layer"])
def test_native_pairs_into_are_forward_pairs_written_in_place(backend):
    """``forward_pairs_into`` writes the rows and tokens ``forward_pairs`` returns into the caller's tensors, bit
    for bit, and its saved state differentiates the same; a full routing, too many pairs for rows or buffers of
    the wrong shape are refused, naming the sizes."""
    native = _native()
    module = native if backend == "native" else PerLayerExperts(native)
    problem = _problem(13, torch.bfloat16, seed=5)
    weights, x, index, w, loras, grad_out = problem
    mask = torch.arange(EXPERTS) % 3 == 0
    pairs = int(mask[index].sum())
    assert 0 < pairs <= 2 * 13
    want_rows, want_at, saved = module.forward_pairs(weights, x, index, w, *loras, expert_mask=mask)
    want_grads = module.backward_pairs(weights, saved, grad_out, *loras)
    rows = torch.full((pairs, HIDDEN), float("nan"))
    at = torch.full((pairs,), -1, dtype=torch.int64)
    saved = module.forward_pairs_into(weights, x, index, w, *loras, expert_mask=mask, rows=rows, tokens=at)
    assert torch.equal(rows, want_rows) and torch.equal(at, want_at)
    grads = module.backward_pairs(weights, saved, grad_out, *loras)
    for a, b in zip((grads[0], grads[1], grads[2], *vars(grads[3]).values()),
                    (want_grads[0], want_grads[1], want_grads[2], *vars(want_grads[3]).values())):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(ValueError, match=f"rows must be float32 or bf16 \\[{pairs}, {HIDDEN}\\]"):
        module.forward_pairs_into(weights, x, index, w, *loras, expert_mask=mask, rows=rows[1:], tokens=at)
    # bf16 rows: each pair's output before its routing weight, the weights apart; weighted in float32 they are the
    # float32 rows bit for bit, and backward is the same
    half = torch.full((pairs, HIDDEN), float("nan"), dtype=torch.bfloat16)
    row_weights = torch.full((pairs,), float("nan"))
    saved = module.forward_pairs_into(weights, x, index, w, *loras, expert_mask=mask, rows=half, tokens=at,
                                      weights_out=row_weights)
    assert torch.equal(half.float() * row_weights.unsqueeze(1), want_rows) and torch.equal(at, want_at)
    assert all((w[at[p]].float() == row_weights[p]).any() for p in range(pairs))  # each a weight of its token
    grads = module.backward_pairs(weights, saved, grad_out, *loras)
    for a, b in zip((grads[0], grads[1], grads[2], *vars(grads[3]).values()),
                    (want_grads[0], want_grads[1], want_grads[2], *vars(want_grads[3]).values())):
        assert (a is None and b is None) or torch.equal(a, b)
    for kwargs in ({}, {"weights_out": row_weights[1:]}):  # bf16 rows without their weights, or the wrong size
        with pytest.raises(ValueError, match="bf16 rows need weights_out"):
            module.forward_pairs_into(weights, x, index, w, *loras, expert_mask=mask, rows=half, tokens=at, **kwargs)
    with pytest.raises(ValueError, match="use forward_pairs"):
        module.forward_pairs_into(weights, x, index, w, *loras, expert_mask=torch.ones(EXPERTS, dtype=torch.bool),
                                  rows=rows, tokens=at)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_native_pairs_backward_takes_any_grad_layout_and_pools_its_rows(dtype):
    """``backward_pairs`` gathers the subset's rows of ``grad_out`` itself: a strided ``grad_out`` gives what its
    contiguous copy gives, bit for bit, in every dtype; and the gathered rows come from the backend's pools, so
    steps after the first allocate nothing new."""
    native = _native()
    weights, x, index, w, loras, _ = _problem(13, torch.bfloat16, seed=6)
    mask = torch.arange(EXPERTS) % 3 == 1
    assert 0 < int(mask[index].sum()) <= 2 * 13
    strided = torch.randn(HIDDEN, 13, generator=torch.Generator().manual_seed(7)).to(dtype).t()
    assert not strided.is_contiguous()
    results, fresh = [], []
    for grad_out in (strided.contiguous(), strided, strided, strided):
        rows, _, saved = native.forward_pairs(weights, x, index, w, *loras, expert_mask=mask)
        grad_rows, grad_at, grad_w, grads = native.backward_pairs(weights, saved, grad_out, *loras)
        results.append([grad_rows.clone(), grad_at, grad_w] + [getattr(grads, n).clone() for n in GRAD_NAMES])
        native.release_result(rows)
        native.release_result(grad_rows)
        for name in GRAD_NAMES:
            native.release_result(getattr(grads, name))
        fresh.append(native.fresh_bytes)
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.equal(a, b)
    assert fresh[1] == fresh[2] == fresh[3], fresh


def test_per_layer_pairs_of_a_layer_the_kernels_do_not_run_are_dense():
    module = PerLayerExperts(_native())
    problem = _problem(5, torch.float32, seed=4)
    weights, x, index, w, loras, grad_out = problem
    mask = torch.arange(EXPERTS) % 2 == 0
    out, at, saved = module.forward_pairs(weights, x, index, w, *loras, expert_mask=mask)
    grad_hidden, grad_at, grad_w, grads = module.backward_pairs(weights, saved, grad_out, *loras)
    want = _run(reference, problem, expert_mask=mask)
    assert at is None and grad_at is None
    for a, b in zip([out, grad_hidden, grad_w] + [getattr(grads, n) for n in GRAD_NAMES], want):
        assert torch.equal(a.float(), b)


def test_rows_pay_up_to_two_pairs_a_token():
    assert rows_pay(0, 0) and rows_pay(26, 13) and not rows_pay(27, 13)
