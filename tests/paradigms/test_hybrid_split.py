"""The hybrid paradigm's split: the chosen GPU set against brute force, the pure-paradigm ends, the forecast and
the online correction of the costs."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace
from typing import Iterable, Sequence

import pytest

from moecc.paradigms.hybrid_split import (CostTracker, RoutingForecast, SideCosts, Split, hit_rate,
                                          physical_costs, plan_split)


def side(split: Split) -> str:
    """``"cpu"``, ``"gpu"`` or ``"both"``: where a pass's work runs."""
    if not split.gpu:
        return "cpu"
    return "gpu" if split.cpu_s == 0.0 else "both"


def forced_split(counts: Sequence[int], gpu: Iterable[int], costs: SideCosts, resident: Iterable[int] = (),
                 committed: Iterable[int] = ()) -> Split:
    """The cost of a given placement (for forced splits and for reporting what ran); ``resident`` and
    ``committed`` as in ``plan_split``."""
    gpu = tuple(sorted(set(gpu)))
    resident, on_gpu = set(resident), set(gpu)
    committed = set(committed) - resident
    cpu = costs.cpu_s(n for e, n in enumerate(counts) if e not in on_gpu)
    copy = costs.copy_expert_s * (len(committed) + sum(1 for e in gpu if e not in resident and e not in committed))
    gpu_s = costs.gpu_s(counts[e] for e in gpu if e < len(counts))
    both = costs.both_sides_s if cpu > 0.0 and gpu else 0.0
    return Split(gpu, max(costs.serial_s + max(cpu, gpu_s), copy) + both, cpu, copy, gpu_s)


COSTS = SideCosts(cpu_expert_s=1e-4, cpu_token_s=2e-5, copy_expert_s=4e-4, gpu_expert_s=1e-5, gpu_token_s=0.0,
                  both_sides_s=2e-4)


@pytest.mark.parametrize("call_s", [0.0, 3e-3])
@pytest.mark.parametrize("seed", range(12))
def test_split_is_the_best_of_every_subset(seed, call_s):
    """With the GPU's per-token cost zero, the best set of a given size is the most-loaded experts, so scoring
    prefixes finds the optimum over all 2^E placements (resident experts included)."""
    rng = random.Random(seed)
    counts = [rng.choice([0, 0, 1, 3, 10, 40, 200]) for _ in range(9)]
    resident = set(rng.sample(range(9), rng.randint(0, 3)))
    costs = replace(COSTS, cpu_call_s=call_s)
    split = plan_split(counts, costs, resident)
    best = min(forced_split(counts, subset, costs, resident).predicted_s
               for m in range(10) for subset in itertools.combinations(
                   [e for e in range(9) if counts[e] > 0], m) if len(subset) <= 9)
    assert split.predicted_s == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert split.predicted_s == pytest.approx(forced_split(counts, split.gpu, costs, resident).predicted_s)
    assert all(counts[e] > 0 for e in split.gpu)


def test_a_split_that_does_not_pay_runs_wholly_on_one_side():
    counts = [5, 3, 2, 0, 1]
    slow_link = SideCosts(1e-4, 1e-5, copy_expert_s=1.0, gpu_expert_s=1e-5, gpu_token_s=0.0)
    assert side(plan_split(counts, slow_link)) == "cpu"
    slow_cpu = SideCosts(1.0, 1.0, copy_expert_s=1e-4, gpu_expert_s=1e-5, gpu_token_s=1e-7)
    split = plan_split(counts, slow_cpu)
    assert side(split) == "gpu" and split.gpu == (0, 1, 2, 4)
    assert side(plan_split([0, 0, 0], COSTS)) == "cpu" and plan_split([0, 0, 0], COSTS).predicted_s == 0.0


def test_balanced_split_takes_the_hot_experts_and_beats_both_pure_sides():
    counts = [400, 300, 200, 100] + [4] * 60  # skewed: a few hot experts, many cold ones
    split = plan_split(counts, COSTS)
    assert side(split) == "both" and set(split.gpu) >= {0, 1, 2, 3}
    all_cpu = forced_split(counts, [], COSTS).predicted_s
    all_gpu = forced_split(counts, [e for e, n in enumerate(counts) if n], COSTS).predicted_s
    assert split.predicted_s < min(all_cpu, all_gpu)
    assert max(split.cpu_s, split.copy_s) == pytest.approx(split.predicted_s - COSTS.both_sides_s)


def test_resident_experts_cost_no_copy_and_go_first():
    counts = [1, 0, 500]
    split = plan_split(counts, COSTS, resident={0})
    assert 0 in split.gpu
    assert forced_split(counts, [0], COSTS, resident={0}).copy_s == 0.0


def test_forecast_averages_recent_passes_and_scores_its_prefetch():
    forecast = RoutingForecast(decay=0.5)
    assert forecast.expected(3) is None
    forecast.observe(3, [4, 0, 2])
    forecast.observe(3, [0, 4, 2])
    assert forecast.expected(3) == [2.0, 2.0, 2.0]
    forecast.observe(3, [1, 1])  # another shape (a different model): starts over
    assert forecast.expected(3) == [1.0, 1.0]
    assert hit_rate([0], [3, 1]) == 0.75 and hit_rate([], [0, 0]) == 1.0 and hit_rate([5], [2]) == 0.0


def test_cost_tracker_follows_measured_rates_under_contention():
    tracker = CostTracker(COSTS, decay=0.5)
    counts = [10, 20]
    predicted = COSTS.cpu_s(counts)
    for _ in range(20):  # the CPU runs 2x slower while the link streams; the link at 80% of its rate
        tracker.observe(counts, 2 * predicted, copied_experts=4, copy_s=4 * COSTS.copy_expert_s / 0.8)
    assert tracker.copy_scale == pytest.approx(1.25, rel=1e-3)
    assert tracker.costs().cpu_s(counts) == pytest.approx(2 * predicted, rel=1e-3)
    # One size cannot tell a fixed cost from a slope: the excess goes to the fixed part, so larger parts are not
    # priced out before one of them was measured ...
    assert tracker.cpu_scale == pytest.approx(1.0, rel=1e-3)
    assert tracker.cpu_fixed_s == pytest.approx(predicted, rel=1e-3)
    bigger = [200, 300]
    for _ in range(3):  # ... and once one was, the slope follows
        tracker.observe(bigger, 2 * COSTS.cpu_s(bigger), 0, 0.0)
    assert tracker.cpu_scale > 1.7
    assert tracker.costs().cpu_s(bigger) == pytest.approx(2 * COSTS.cpu_s(bigger), rel=0.1)
    tracker.observe(counts, 1000 * predicted, 0, 0.0)  # one wild pass (clamped to 4x) moves the fit little
    assert tracker.costs().cpu_s(counts) < 2 * predicted * 2


def _fitted(decay: float, fixed: float, slope: float, seed: int, samples: int) -> CostTracker:
    """A tracker fed ``samples`` CPU parts of random sizes that cost exactly ``fixed + slope * predicted``."""
    tracker = CostTracker(COSTS, decay=decay)
    rng = random.Random(seed)
    for _ in range(samples):
        counts = [rng.randint(1, 80) for _ in range(rng.randint(1, 40))]
        tracker.observe(counts, fixed + slope * COSTS.cpu_s(counts), 0, 0.0)
    return tracker


def test_cost_tracker_fit_is_the_least_squares_line_where_sizes_differ():
    """Against unweighted least squares on exact data (decay 0: every sample weighs the same): the prior moves a
    well-posed fit by little."""
    tracker = _fitted(0.0, 0.004, 0.6, seed=3, samples=40)
    assert tracker.cpu_fixed_s == pytest.approx(0.004, rel=0.02)
    assert tracker.cpu_scale == pytest.approx(0.6, rel=0.02)
    assert len(tracker.recent) == 40 and all(y > x * 0.6 for x, y in tracker.recent)


def test_cost_tracker_separates_the_cpu_parts_fixed_cost_from_its_slope():
    """CPU parts of several sizes that cost 10 ms each plus 1.5x the predicted work: the fit finds both, and the
    split then charges the fixed cost to any pass with a CPU part."""
    tracker = _fitted(0.5, 0.01, 1.5, seed=0, samples=60)
    assert tracker.cpu_fixed_s == pytest.approx(0.01, rel=0.05)
    assert tracker.cpu_scale == pytest.approx(1.5, rel=0.05)
    costs = tracker.costs()
    assert costs.cpu_s([3, 0]) == pytest.approx(0.01 + 1.5 * COSTS.cpu_s([3]), rel=0.05)
    assert costs.cpu_s([0, 0]) == 0.0


def test_a_fit_that_priced_the_cpu_out_starts_over_and_relearns():
    """A fit that learnt a fixed cost too large for any split keeps the CPU out, and passes without a CPU part
    teach it nothing. After ``probe_after`` such passes the fit starts over from its slope: the plan takes a CPU
    part again, and that part's sample sets the costs."""
    counts = [200, 150, 90, 40, 30, 20, 10, 5]
    costs = replace(COSTS, copy_expert_s=2e-3)
    tracker = CostTracker(costs, decay=0.5, probe_after=3)
    rng = random.Random(1)
    for _ in range(30):  # samples that put a 50 ms fixed cost on every CPU part
        part = [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
        tracker.observe(part, 0.05 + costs.cpu_s(part), 0, 0.0)
    assert tracker.cpu_fixed_s > 0.03  # (each sample's pull is bounded: the fit approaches it)
    assert side(plan_split(counts, tracker.costs())) == "gpu"
    for _ in range(2):
        tracker.ran(cpu_part=False)
    assert side(plan_split(counts, tracker.costs())) == "gpu"
    tracker.ran(cpu_part=False)
    probe = plan_split(counts, tracker.costs())
    assert side(probe) == "both"
    cpu = [n for e, n in enumerate(counts) if e not in probe.gpu]
    tracker.observe(cpu, 1.2 * costs.cpu_s(cpu), 0, 0.0)  # the CPU part costs what the first costs said, +20%
    tracker.ran(cpu_part=True)
    assert tracker.costs().cpu_s(cpu) == pytest.approx(1.2 * costs.cpu_s(cpu), rel=1e-6)
    for _ in range(2):  # fewer passes without the CPU than probe_after: the fit stays
        tracker.ran(cpu_part=False)
    assert tracker.costs().cpu_s(cpu) == pytest.approx(1.2 * costs.cpu_s(cpu), rel=1e-6)
    never = CostTracker(costs, probe_after=0)
    never.observe([5], 0.05, 0, 0.0)
    fitted = never.costs()
    for _ in range(100):
        never.ran(cpu_part=False)
    assert never.costs() == fitted


def test_physical_costs_for_qwen3_shape_match_the_host_model():
    """The reference machine: a Qwen3-30B-A3B layer's experts (128 x 3 x 2048 x 768 bf16) take 21.8 ms over 55 GB/s and about
    9.7 ms from DRAM at 125 GB/s."""
    costs = physical_costs(2048, 768, 8, dram_gbps=125, cpu_tflops=4, pcie_gbps=55.4, gpu_tflops=680)
    assert 128 * costs.copy_expert_s == pytest.approx(21.8e-3, rel=0.02)
    assert 128 * (costs.cpu_expert_s - 2e-5) == pytest.approx(9.7e-3, rel=0.03)
    backward = physical_costs(2048, 768, 8, 125, 4, 55.4, 680, backward=True)
    assert backward.cpu_token_s == pytest.approx(2 * costs.cpu_token_s)


def _brute_force(counts, score) -> float:
    routed = [e for e in range(len(counts)) if counts[e] > 0]
    return min(score(subset) for m in range(len(routed) + 1) for subset in itertools.combinations(routed, m))


@pytest.mark.parametrize("seed", range(12))
def test_committed_copies_are_charged_and_the_split_is_still_the_best(seed):
    """Experts a prefetch already copied for this pass cost their copies whatever runs where (the copy engine
    spent that time), so the planner weighs a missed expert's copy against the CPU beside them."""
    rng = random.Random(seed)
    counts = [rng.choice([0, 1, 3, 10, 40, 200]) for _ in range(9)]
    committed = set(rng.sample(range(9), rng.randint(1, 5)))
    costs = replace(COSTS, cpu_call_s=rng.choice([0.0, 3e-3]))
    split = plan_split(counts, costs, committed=committed)
    best = _brute_force(counts, lambda gpu: forced_split(counts, gpu, costs, committed=committed).predicted_s)
    assert split.predicted_s == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert split.copy_s >= len(committed) * costs.copy_expert_s - 1e-15


def test_committed_copies_tip_missed_experts_to_the_cpu():
    counts = [50] * 6 + [2] * 6
    cheap_cpu = replace(COSTS, cpu_expert_s=2e-4, cpu_token_s=1e-6)
    # The six hot ones already on their way: they run on the GPU, and copying the cold six too would only
    # lengthen the link's queue.
    assert plan_split(counts, cheap_cpu, committed=range(6)).gpu == (0, 1, 2, 3, 4, 5)
    # Were the six copies not charged (the old rule), copying the cold ones now would look free of cost.
    uncharged = plan_split(counts, cheap_cpu, resident=range(6))
    assert len(uncharged.gpu) > 6


@pytest.mark.parametrize("seed", range(12))
def test_split_for_both_passes_minimises_their_sum(seed):
    """One split serves forward and backward; with ``then`` it minimises both passes' seconds together."""
    rng = random.Random(seed)
    counts = [rng.choice([0, 1, 3, 10, 40, 200]) for _ in range(9)]
    forward = replace(COSTS, cpu_call_s=rng.choice([0.0, 3e-3]), serial_s=rng.choice([0.0, 1e-3, 4e-3]))
    backward = replace(forward, cpu_expert_s=2 * forward.cpu_expert_s, cpu_token_s=2.5 * forward.cpu_token_s)
    split = plan_split(counts, forward, then=backward)
    best = _brute_force(counts, lambda gpu: forced_split(counts, gpu, forward).predicted_s
                        + forced_split(counts, gpu, backward).predicted_s)
    got = forced_split(counts, split.gpu, forward).predicted_s + forced_split(counts, split.gpu, backward).predicted_s
    assert got == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert split.predicted_s == pytest.approx(forced_split(counts, split.gpu, forward).predicted_s)


def _grown_backward_s(counts, gpu, grown, forward, backward) -> float:
    """A backward running ``grown`` (a superset of its forward's ``gpu``) on the GPU: where it grew, the GPU
    recomputes the forward of every one of its experts first."""
    split = forced_split(counts, grown, backward)
    if set(grown) == set(gpu):
        return split.predicted_s
    recompute = forced_split(counts, grown, forward).gpu_s
    both = backward.both_sides_s if split.cpu_s > 0.0 else 0.0
    return max(backward.serial_s + max(split.cpu_s, split.gpu_s + recompute), split.copy_s) + both


def test_serial_gpu_work_delays_both_sides_and_only_copies_overlap_it():
    """The GPU's work between layers comes before either side's experts: a pass costs max(serial + max(CPU, GPU),
    copy), so with the link idle the split still balances CPU against GPU, and long copies hide the gap."""
    costs = SideCosts(cpu_expert_s=4e-3, cpu_token_s=0.0, copy_expert_s=0.0, gpu_expert_s=5e-3, gpu_token_s=0.0,
                      both_sides_s=0.0, serial_s=10e-3)
    split = plan_split([1, 1], costs, resident={0, 1})
    assert len(split.gpu) == 1 and split.predicted_s == pytest.approx(15e-3)  # all on the GPU: 20 ms
    assert forced_split([1, 1], [0, 1], costs, resident={0, 1}).predicted_s == pytest.approx(20e-3)
    slow_link = replace(costs, copy_expert_s=30e-3)
    assert forced_split([1, 1], [0, 1], slow_link).predicted_s == pytest.approx(60e-3)  # the copies hide the gap
    assert forced_split([1, 1], [], slow_link).predicted_s == pytest.approx(18e-3)  # the CPU does not


def test_tracker_follows_each_passs_median_gap_up_quickly_and_down_slowly():
    """A pass's median gap sets the first estimate; longer gaps move it half the way, shorter ones a tenth, so
    passes that waited on copies (the GPU's share of the gap alone) wear down the gap a CPU-bound pass measured
    only over several steps; a pass with no gap (or only negative readings) changes nothing."""
    tracker = CostTracker(COSTS, serial_rise=0.5, serial_fall=0.1)
    assert tracker.costs().serial_s == COSTS.serial_s
    tracker.observe_serial([1e-3, 4e-3, 4e-3, 50e-3])  # one outlier: the median is 4 ms
    assert tracker.costs().serial_s == pytest.approx(4e-3)
    tracker.observe_serial([1e-3, 1e-3, 2e-3])
    assert tracker.costs().serial_s == pytest.approx(4e-3 - 0.1 * 3e-3)
    tracker.observe_serial([])
    tracker.observe_serial([-1.0])
    assert tracker.costs().serial_s == pytest.approx(3.7e-3)
    tracker.observe_serial([5.7e-3])
    assert tracker.costs().serial_s == pytest.approx(4.7e-3)
    estimates = []
    for step in range(10):  # copy-bound passes (1 ms) with a CPU-bound one (4 ms) every fifth step
        tracker.observe_serial([4e-3 if step % 5 == 4 else 1e-3] * 8)
        estimates.append(tracker.serial_s)
    assert min(estimates) > 2.5e-3  # a plain average of the passes would sit near 1.6 ms


def test_each_batch_size_keeps_its_own_serial_estimate():
    """The attention's share of the gap grows with the tokens: a step of another size neither raises nor wears
    down a size's estimate; a size not measured yet plans with the estimate measured last."""
    tracker = CostTracker(COSTS)
    tracker.observe_serial([20e-3], size=8192)
    tracker.observe_serial([4e-3], size=512)
    assert tracker.costs(8192).serial_s == pytest.approx(20e-3)
    assert tracker.costs(512).serial_s == pytest.approx(4e-3)
    assert tracker.costs(2048).serial_s == pytest.approx(4e-3)
    tracker.observe_serial([1e-3], size=512)
    tracker.observe_serial([30e-3], size=8192)
    assert tracker.costs(512).serial_s == pytest.approx(4e-3 - 0.1 * 3e-3)
    assert tracker.costs(8192).serial_s == pytest.approx(25e-3)


@pytest.mark.parametrize("seed", range(8))
def test_required_experts_stay_on_the_gpu_and_the_rest_is_the_best_completion(seed):
    """A backward's split keeps the forward's GPU experts there (``required``) and picks the best of every
    completion of them by the other routed experts."""
    rng = random.Random(seed)
    counts = [rng.choice([0, 1, 3, 10, 40, 200]) for _ in range(8)]
    required = set(rng.sample([e for e in range(8) if counts[e] > 0], 2)) if sum(n > 0 for n in counts) > 2 else set()
    costs = replace(COSTS, copy_expert_s=3e-3)  # copies dear: unconstrained, the CPU would take most
    split = plan_split(counts, costs, required=required)
    assert required <= set(split.gpu)
    others = [e for e in range(8) if counts[e] > 0 and e not in required]
    best = min(forced_split(counts, required | set(extra), costs).predicted_s
               for m in range(len(others) + 1) for extra in itertools.combinations(others, m))
    assert split.predicted_s == pytest.approx(best, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("seed", range(8))
def test_a_backward_growing_beyond_its_required_experts_pays_the_recomputed_forward(seed):
    """With ``recompute`` (the forward's costs), a backward's split that takes more than its ``required`` experts
    pays the GPU's forward of all of them first; the choice is the best completion at that price."""
    rng = random.Random(seed)
    counts = [rng.choice([1, 3, 10, 40, 200]) for _ in range(7)]
    required = set(rng.sample(range(7), 2))
    forward = replace(COSTS, gpu_expert_s=rng.choice([1e-5, 3e-4]))  # no per-token GPU cost: prefixes are best
    backward = replace(forward, cpu_expert_s=5 * forward.cpu_expert_s, cpu_token_s=5 * forward.cpu_token_s)
    split = plan_split(counts, backward, required=required, recompute=forward)
    assert required <= set(split.gpu)
    others = [e for e in range(7) if e not in required]
    scores = [_grown_backward_s(counts, required, required | set(extra), forward, backward)
              for m in range(len(others) + 1) for extra in itertools.combinations(others, m)]
    assert _grown_backward_s(counts, required, split.gpu, forward, backward) == pytest.approx(min(scores), rel=1e-12)
    assert split.predicted_s == pytest.approx(_grown_backward_s(counts, required, split.gpu, forward, backward))


def test_a_split_saving_less_than_running_both_sides_costs_stays_on_the_gpu():
    """Large batches on a fast link: the CPU's share of the best split is a few cold experts, whose copies save less
    than the default fixed cost of a pass on both sides, so the pass runs wholly on the GPU; with that cost at
    zero the same counts would split."""
    counts = [600] * 124 + [8] * 4  # 4 cold experts
    costs = SideCosts(cpu_expert_s=2e-3, cpu_token_s=2e-5, copy_expert_s=1.8e-4, gpu_expert_s=1.5e-5,
                      gpu_token_s=3e-8, serial_s=3e-3)
    split = plan_split(counts, costs)
    free = plan_split(counts, replace(costs, both_sides_s=0.0))
    assert side(free) == "both" and 0 < free.cpu_s and len(free.gpu) < 128
    assert side(split) == "gpu" and len(split.gpu) == 128
    saved = (128 - len(free.gpu)) * costs.copy_expert_s
    assert saved < SideCosts.both_sides_s == costs.both_sides_s
