"""The native extension: token grouping, the thread pool, CPU features and the AMX self-check."""
from __future__ import annotations

import warnings

import pytest
import torch

from moecc import _C, _ops


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(0, 2, 4), (1, 1, 1), (7, 3, 5), (50_000, 8, 128)])
def test_grouping_is_a_stable_sort_by_expert(num_tokens, top_k, num_experts):
    g = torch.Generator().manual_seed(num_tokens)
    # Skewed routing: expert 0 gets about half of all pairs.
    index = torch.where(torch.rand(num_tokens, top_k, generator=g) < 0.5, 0,
                        torch.randint(0, num_experts, (num_tokens, top_k), generator=g))
    offsets, order = _ops.group_tokens_by_expert(index, num_experts)
    flat = index.reshape(-1)
    expected_order = torch.sort(flat, stable=True).indices
    assert torch.equal(order, expected_order)
    counts = torch.bincount(flat, minlength=num_experts)
    assert torch.equal(offsets, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))


@pytest.mark.parametrize("num_tokens", [0, 9, 50_000])
def test_grouping_of_kept_experts_is_the_full_grouping_without_the_others(num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    index = torch.randint(0, 6, (num_tokens, 3), generator=g)
    full_offsets, full_order = _ops.group_tokens_by_expert(index, 6)
    keep = torch.tensor([True, False, False, True, True, False])
    offsets, order = _ops.group_tokens_by_expert(index, 6, keep)
    counts = full_offsets.diff() * keep
    assert torch.equal(offsets, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
    bounds = full_offsets.tolist()
    want = [full_order[bounds[e]:bounds[e + 1]] for e in range(6) if keep[e]]
    assert torch.equal(order, torch.cat(want))


def test_grouping_of_kept_experts_checks_every_id_and_the_flags():
    with pytest.raises(ValueError, match=r"top_k_index\[1, 1\] = 9"):  # an expert that is not kept, too
        _ops.group_tokens_by_expert(torch.tensor([[0, 1], [2, 9]]), 4, torch.tensor([True, False, False, False]))
    with pytest.raises(ValueError, match=r"keep must be a bool \[4\] tensor"):
        _ops.group_tokens_by_expert(torch.tensor([[0, 1]]), 4, torch.ones(3, dtype=torch.bool))


def test_grouping_rejects_bad_ids_and_shapes():
    with pytest.raises(ValueError, match=r"top_k_index\[1, 0\] = -1"):
        _ops.group_tokens_by_expert(torch.tensor([[0, 1], [-1, 2]]), 4)
    with pytest.raises(ValueError, match="tokens, top_k"):
        _ops.group_tokens_by_expert(torch.tensor([0, 1]), 4)


def test_pool_runs_every_task_once():
    out = _ops.pool_fill_test(100_003)
    assert torch.equal(out, torch.arange(100_003) * 2 + 1)


def test_pool_exception_reaches_python_and_pool_survives():
    with pytest.raises(RuntimeError, match="task 17 failed on purpose"):
        _ops.pool_raise_test(1000, 17)
    assert torch.equal(_ops.pool_fill_test(10), torch.arange(10) * 2 + 1)


def test_pool_can_be_resized():
    try:
        _ops.set_num_threads(3)
        assert _ops.num_threads() == 3
        assert torch.equal(_ops.pool_fill_test(1000), torch.arange(1000) * 2 + 1)
    finally:
        _ops.set_num_threads(0)
    assert _ops.num_threads() == _ops.available_cpus()


def test_pool_can_be_replaced_while_another_thread_runs_jobs():
    import threading

    stop = threading.Event()
    failures = []

    def run_jobs():
        while not stop.is_set():
            if not torch.equal(_ops.pool_fill_test(20_000), torch.arange(20_000) * 2 + 1):
                failures.append("wrong result")

    worker = threading.Thread(target=run_jobs)
    worker.start()
    try:
        for threads in (1, 2, 3, 2, 1, 2) * 3:
            _ops.set_num_threads(threads)
    finally:
        stop.set()
        worker.join(timeout=30)
        _ops.set_num_threads(0)
    assert not worker.is_alive() and not failures


def test_configure_pool_applies_pinning_choice():
    try:
        _ops.configure_pool(2, pin_threads=False)
        assert _ops.num_threads() == 2
        from moecc import _C

        assert _C.pool_pinned() is False
    finally:
        _ops.configure_pool(None, pin_threads=True)


def test_grouping_rejects_float_ids():
    with pytest.raises(ValueError, match="integer expert ids"):
        _ops.group_tokens_by_expert(torch.tensor([[0.0, 1.0]]), 4)


def test_cpu_features_and_best_isa_agree():
    features = _ops.cpu_features()
    assert {"avx512_bf16", "amx_bf16", "os_amx", "brand"} <= set(features)
    best = _ops.best_isa()
    _ops.check_isa(best)
    if features["avx512_bf16"] and features["os_avx512"]:
        assert best in ("avx512_bf16", "amx")


def test_peak_rate_micro_benchmark():
    from moecc import _C

    features = _ops.cpu_features()
    if features["avx512_bf16"] and features["os_avx512"]:
        assert _C.peak_flops("avx512_bf16", 100_000) > 1e9
    else:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            _C.peak_flops("avx512_bf16", 10)
    if not features["os_amx"]:
        with pytest.raises(ValueError, match="AMX"):
            _C.peak_flops("amx", 10)
    if features["avx512f"] and features["os_avx512"]:
        fma = _C.peak_flops("avx512_fma", 100_000)
        assert 1e9 < fma < 1e12  # float32 FMA of one core: tens to hundreds of GFLOP/s
    else:
        with pytest.raises(ValueError, match="AVX512F"):
            _C.peak_flops("avx512_fma", 10)
    with pytest.raises(ValueError, match="unknown unit 'avx2'"):
        _C.peak_flops("avx2", 10)


def test_amx_self_check_passes_wherever_the_hardware_has_amx():
    """The check runs exactly where cpuid, XCR0 and the kernel offer AMX, and there it must pass: a failure here is
    a broken AMX build (the GCC 12 tile-configuration bug read back wrong), not a reason to skip."""
    check = _ops.amx_self_check()
    if "amx" in _ops.hardware_isas():
        assert check == {"ran": True, "ok": True, "reason": ""}
        assert _ops.best_isa() == "amx"
        _ops.check_isa("amx")
    else:
        assert not check["ran"] and not check["ok"]
        assert "AMX" in check["reason"]
        assert _ops.best_isa() != "amx"
        with pytest.raises(ValueError, match="AMX"):
            _ops.check_isa("amx")


@pytest.mark.amx
@pytest.mark.parametrize("fault, words", [(1, "read back wrong"), (2, "differs from the portable")])
def test_failed_amx_self_check_makes_auto_fall_back(fault, words):
    """A self-check failure (injected by the test hook into what the check compares) keeps AMX from ever being
    handed out: ``auto`` warns once and takes AVX512-BF16, an explicit AMX request gets an error naming the fix."""
    if "amx" not in _ops.hardware_isas():
        pytest.skip("needs a CPU with AMX (amx_tile, amx_bf16 and the kernel's tile-data permission)")
    from moecc.experts.native import NativeExperts

    _ops._reset_amx_self_check(fault)
    try:
        check = _ops.amx_self_check()
        assert check["ran"] and not check["ok"] and words in check["reason"]
        with pytest.warns(RuntimeWarning, match="self-check failed"):
            assert _ops.best_isa() == "avx512_bf16"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process, not once per call
            assert _ops.best_isa() == "avx512_bf16"
        with pytest.raises(ValueError, match="self-check failed.*MOECC_ISA=avx512_bf16"):
            _ops.check_isa("amx")
        with pytest.raises(ValueError, match="self-check failed"):
            NativeExperts("amx")
        with pytest.raises(ValueError, match="self-check failed"):
            _C.peak_flops("amx", 10)
    finally:
        _ops._reset_amx_self_check(0)
    assert _ops.amx_self_check()["ok"] and _ops.best_isa() == "amx"
