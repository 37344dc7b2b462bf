"""The planner: predictions from rates, the crossover, and the rate cache (machine rates once, each shape once)."""
import argparse
import json
import warnings
import weakref

import pytest
import torch

from moecc import cli
from moecc.bench import rates as rates_module
from moecc.bench import rates_cache
from moecc.bench.plan import crossover, predict
from moecc.bench.presets import PRESETS, preset_config


def key_of(preset):
    return rates_module.shape_key(rates_module.moe_shape(preset_config(preset)))


def lines(counts, **parts):
    """Shape rates whose entries are straight lines ``(seconds at zero tokens, seconds per token)``."""
    return {name: [a + b * count for count in counts] for name, (a, b) in parts.items()}


def qwen3_rates(cpu_fixed=0.02, cpu_per_token=3e-5, **machine):
    """Synthetic rates for Qwen3-30B-A3B's shape: CPU kernels with a fixed cost per pass, PCIe 55 GB/s."""
    counts, gpu_counts = [512, 2048, 8192], [512, 2048]
    shape = {"tokens": counts, "gpu_tokens": gpu_counts,
             **lines(counts, cpu_forward_s=(cpu_fixed, cpu_per_token), cpu_backward_s=(cpu_fixed, cpu_per_token)),
             **lines(gpu_counts, gpu_experts_forward_s=(0.003, 1e-6), gpu_experts_backward_s=(0.006, 2e-6),
                     gpu_attention_layer_s=(0.002, 1e-6), gpu_attention_rest_s=(0.005, 2e-6),
                     gpu_layer_s=(0.006, 2e-6), gpu_rest_s=(0.005, 2e-6))}
    return {"dram_gbps": 125.0, "cpu_matmul_tflops": 4.0, "host_optimizer_ns_per_param": 0.5, "h2d_gbps": 55.0,
            "d2h_gbps": 55.0, "gpu_tflops": 700.0, **machine, "shapes": {key_of("qwen3-30b-a3b"): shape}}


def tiny_rates(**machine):
    """Round numbers for the tiny preset (E=8, k=2, H=64, I=32), timed at 100 and 300 tokens."""
    shape = {"tokens": [100, 300], "gpu_tokens": [100, 300],
             "cpu_forward_s": [0.010, 0.030], "cpu_backward_s": [0.020, 0.040],
             "gpu_experts_forward_s": [0.001, 0.003], "gpu_experts_backward_s": [0.002, 0.004],
             "gpu_attention_layer_s": [0.004, 0.006], "gpu_attention_rest_s": [0.010, 0.020],
             "gpu_layer_s": [0.005, 0.009], "gpu_rest_s": [0.011, 0.021]}
    # DRAM and GPU matmul so fast that their floors never bind; PCIe so slow that offload's copies do.
    return {"dram_gbps": 1e6, "cpu_matmul_tflops": 1e-3, "host_optimizer_ns_per_param": 1.0, "h2d_gbps": 0.001,
            "d2h_gbps": 0.002, "gpu_tflops": 1e6, **machine, "shapes": {key_of("tiny"): shape}}


def test_predictions_reproduce_hand_computed_numbers():
    times = predict("tiny", 200, tiny_rates(), layers=3)  # halfway between the timed token counts
    optimizer = 3 * 8 * 8 * (2 * 64 + 3 * 32) * 1e-9  # 3 layers x rank x E x (2H + 3I) factors, 1 ns each
    activations = (2 * 200 * 64 * 2 + 12 * 400) / 2e6 + (2 * 200 * 64 * 2 + 4 * 400) / 1e6  # down, then up
    assert times["cocompute"] == pytest.approx(3 * (0.005 + 0.020 + 0.030 + activations) + 0.015 + optimizer)
    copy = 8 * 3 * 64 * 32 * 2 / 1e6  # all 8 experts are routed at 200 tokens
    forward = copy + (0.002 + 0.005 / 2) + 2 * copy  # the first copy exposed, the next two overlap compute
    parked = (200 * 64 * 2 + 400 * (4 + 8 + 2 * 32 * 2)) / 1e6  # hidden states; per pair weight, index, gate/up
    backward = 2 * (0.003 + 0.005 / 2 + parked) + copy + parked  # the last two layers' weights are on the GPU
    assert times["offload"] == pytest.approx(forward + backward + 0.015)  # expert LoRA stepped on the GPU
    host_lora = predict("tiny", 200, tiny_rates(), layers=3, offload_lora_on_device=False)
    lora_bytes = 4 * 3 * 8 * 8 * (2 * 64 + 3 * 32)  # float32 factors, each way once a step
    assert host_lora["offload"] == pytest.approx(forward + backward + 0.015 + optimizer
                                                 + lora_bytes / 1e6 + lora_bytes / 2e6)
    assert times["gpu"] == pytest.approx(3 * 0.007 + 0.016)
    # Checkpointing: attention a third more; no shared expert carries the recomputation through the routed ones
    # (Qwen3), so the experts run as without it and their parked state comes back
    again = predict("tiny", 200, tiny_rates(), layers=3, checkpointing=True)
    attention = 0.005 * 4 / 3
    forward = copy + (0.002 + attention / 2) + 2 * copy
    backward = 2 * (0.003 + attention / 2 + parked) + copy + parked
    assert again["offload"] == pytest.approx(forward + backward + 0.015)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_checkpointing_reruns_the_routed_experts_only_where_the_planner_says(family):
    """The planner's assumption, on the engine: under Hugging Face's non-reentrant checkpointing the offloaded
    experts run once per layer and step unless a shared expert after them (Qwen2-MoE) carries the
    recomputation through them, and their backward uses the state the first forward parked either way."""
    import torch

    from moecc.bench.plan import _recomputes_experts
    from moecc.bench.shapes import moe_shape
    from moecc.paradigms import offload as offload_module

    from ..parity import build_pair, lora_config

    _, engine = build_pair(family, torch.float32, lora_config(family), paradigm="offload", num_hidden_layers=2)
    engine.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine.train()
    calls, original = [], offload_module.OffloadExpertsFunction.forward

    def counting(ctx, hidden, weights, index, layer, lora, call, *rest):
        calls.append(call.recompute)
        return original(ctx, hidden, weights, index, layer, lora, call, *rest)

    offload_module.OffloadExpertsFunction.forward = staticmethod(counting)
    try:
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
        state = engine.moecc.engine
        state.reset_metrics()
        engine(input_ids=ids, labels=ids).loss.backward()
    finally:
        offload_module.OffloadExpertsFunction.forward = original
    again = _recomputes_experts(moe_shape(engine.config), True)
    assert again == (family == "qwen2_moe")
    assert calls == [False, False] + ([True, True] if again else [])
    assert state.slots.parking.bytes_to_device == state.slots.parking.bytes_to_host > 0


def test_without_a_gpu_only_cocompute_is_predicted_all_on_the_cpu():
    cpu_only = {k: v for k, v in tiny_rates().items() if k not in ("h2d_gbps", "d2h_gbps", "gpu_tflops")}
    times = predict("tiny", 200, cpu_only, layers=3)
    attention = 4 * 200 * 64 * 16 * 2 * (4 + 2) + 6 * 200 * 200 * 4 * 16  # projections, then scores
    layer_flops, head_flops = attention + 4 * 200 * 64 * 8, 4 * 200 * 256 * 64  # + router; LM head
    optimizer = 3 * 8 * 8 * (2 * 64 + 3 * 32) * 1e-9
    assert times == {"cocompute": pytest.approx(3 * (layer_flops / 1e9 + 0.05) + head_flops / 1e9 + optimizer)}
    assert crossover("tiny", cpu_only) is None


def test_cocompute_timed_in_place_is_predicted_from_its_own_steps():
    timed = {"cocompute_layer_s": [0.03, 0.05], "cocompute_rest_s": [0.010, 0.020]}
    rates = tiny_rates()
    rates["shapes"][key_of("tiny")].update(timed)
    layer, rest = 0.04, 0.015  # halfway between the timings at 100 and 300 tokens
    assert predict("tiny", 200, rates, layers=3)["cocompute"] == pytest.approx(3 * layer + rest)
    # with checkpointing the GPU recomputes each layer's attention (a third of its 5 ms); the CPU experts replay
    assert predict("tiny", 200, rates, layers=3, checkpointing=True)["cocompute"] == pytest.approx(
        3 * (layer + 0.005 / 3) + rest)
    cpu_only = {k: v for k, v in rates.items() if k not in ("h2d_gbps", "d2h_gbps", "gpu_tflops")}
    assert predict("tiny", 200, cpu_only, layers=3) == {"cocompute": pytest.approx(3 * layer + rest)}
    # Another rank: the layer's expert work scales with the LoRA FLOPs, its host-optimizer share with the rank.
    optimizer = {r: r * 8 * (2 * 64 + 3 * 32) * 1e-9 for r in (8, 64)}  # per layer: r x E x (2H + 3I), 1 ns each
    flops = {r: 1 + r * (2 * 64 + 3 * 32) / (3 * 64 * 32) for r in (8, 64)}
    expected = 3 * ((layer - optimizer[8]) * flops[64] / flops[8] + optimizer[64]) + rest
    assert predict("tiny", 200, rates, layers=3, rank=64)["cocompute"] == pytest.approx(expected)


def test_shape_rates_time_cocompute_steps_in_place():
    shape = rates_module.measure_shape("tiny")
    assert len(shape["cocompute_layer_s"]) == len(shape["tokens"]) == len(shape["cocompute_rest_s"])
    assert all(t >= 0 for t in shape["cocompute_layer_s"] + shape["cocompute_rest_s"])
    assert sum(shape["cocompute_layer_s"]) + sum(shape["cocompute_rest_s"]) > 0


def test_offload_prediction_follows_the_slots_the_engine_gets():
    """More slots keep more layers on the GPU at the forward/backward turn: fewer copies, no slower a step."""
    rates = qwen3_rates()
    default = predict("qwen3-30b-a3b", 512, rates)["offload"]
    assert predict("qwen3-30b-a3b", 512, rates, offload_slots=2)["offload"] == default  # MoeccConfig's default
    assert predict("qwen3-30b-a3b", 512, rates, offload_slots=6)["offload"] < default


def test_predictions_grow_with_tokens_and_scale_linearly_with_layers():
    rates = qwen3_rates()
    counts = [16 * 2**i for i in range(11)]
    for paradigm in ("cocompute", "offload", "gpu"):
        times = [predict("qwen3-30b-a3b", count, rates, layers=8)[paradigm] for count in counts]
        assert times == sorted(times), paradigm
        four, eight, twelve = (predict("qwen3-30b-a3b", 2048, rates, layers)[paradigm] for layers in (4, 8, 12))
        assert eight - four == pytest.approx(twelve - eight), paradigm
    # A larger LoRA rank costs more (more host optimizer work, more LoRA FLOPs), never less.
    base, larger = (predict("qwen3-30b-a3b", 2048, rates, rank=rank) for rank in (8, 64))
    assert all(larger[p] >= base[p] for p in base) and larger["cocompute"] > base["cocompute"]


def test_crossover_is_where_offload_gets_faster():
    rates = qwen3_rates(cpu_fixed=0.005, cpu_per_token=1e-5)  # ~44 ms of copies per layer cross at ~1.7 k
    point = crossover("qwen3-30b-a3b", rates)
    assert point == 2048
    before, at = predict("qwen3-30b-a3b", point // 2, rates), predict("qwen3-30b-a3b", point, rates)
    assert before["cocompute"] <= before["offload"] and at["offload"] < at["cocompute"]
    assert crossover("qwen3-30b-a3b", qwen3_rates(0.005, 1e-9), limit=1 << 14) is None  # the CPU stays ahead
    assert crossover("qwen3-30b-a3b", qwen3_rates(0.05, 1e-5)) == 16  # the CPU's fixed cost alone loses


def test_plain_rates_without_the_shape_are_refused():
    with pytest.raises(ValueError, match="no timings of qwen3-30b-a3b's shape"):
        predict("qwen3-30b-a3b", 512, tiny_rates())


def test_rates_are_measured_once_and_each_shape_once(tmp_path, monkeypatch):
    measured = []
    real = rates_module.measure_shape
    monkeypatch.setattr(rates_module, "measure_shape", lambda preset: measured.append(preset) or real(preset))
    monkeypatch.setitem(PRESETS, "tiny-wide", {**PRESETS["tiny"], "hidden_size": 128})
    rates = rates_module.measure()
    assert rates["dram_gbps"] > 0 and rates["cpu_matmul_tflops"] > 0 and rates["shapes"] == {}
    first = predict("tiny", 64, rates)
    assert set(first) == ({"cocompute", "offload", "gpu"} if torch.cuda.is_available() else {"cocompute"})
    predict("tiny", 256, rates, layers=5)  # the same shape with more layers: nothing new to time
    assert measured == ["tiny"]
    saved = json.loads(rates_cache.CACHE.read_text())
    assert saved["version"] == rates_cache.VERSION and list(saved["shapes"]) == [key_of("tiny")]

    again = rates_module.measure()  # from the cache, with the tiny shape's timings
    assert predict("tiny", 64, again) == first and measured == ["tiny"]
    predict("tiny-wide", 64, again)  # a new shape is timed, and saved next to the first
    assert measured == ["tiny", "tiny-wide"] and len(rates_module.measure()["shapes"]) == 2

    cached = json.loads(rates_cache.CACHE.read_text())
    rates_cache.CACHE.write_text(json.dumps({**cached, "dram_gbps": 1234.0}))
    assert rates_module.measure()["dram_gbps"] == 1234.0
    assert rates_module.measure(remeasure=True)["shapes"] == {}  # remeasuring starts over, shapes included
    rates_cache.CACHE.write_text(json.dumps({"dram_gbps": 1.0, "cpu_expert_tflops": 1.0}))  # an older layout
    assert "host_optimizer_ns_per_param" in rates_module.measure()


def test_plan_command_predicts_and_says_what_it_timed(capsys):
    out = cli.plan(argparse.Namespace(preset="tiny", layers=4, tokens=[64, 256], remeasure=False))
    assert set(out["predictions"]) == {64, 256} and out["rates"]["dram_gbps"] > 0
    printed = capsys.readouterr().out
    assert "timed on one tiny MoE layer" in printed and "CPU experts (ours): 128 tokens" in printed


def test_plan_command_says_what_auto_would_pick_from_gpu_rates(capsys, monkeypatch):
    monkeypatch.setattr(rates_module, "measure", lambda remeasure=False: qwen3_rates(cpu_per_token=3e-6))
    out = cli.plan(argparse.Namespace(preset="qwen3-30b-a3b", layers=48, tokens=[2048], remeasure=False))
    printed = capsys.readouterr().out
    assert out["predictions"][2048]["hybrid"] < out["predictions"][2048]["offload"]
    assert "paradigm='auto' picks 'hybrid' for this model: predicted seconds per step" in printed


def test_auto_paradigm_without_readable_rates_for_the_shape_picks_nothing():
    """``auto`` falls back (None: offload, with the command that measures) where the cache cannot price the model:
    no shape timed, no GPU rates, timings cut short, or a config that is not a MoE's."""
    from moecc.bench.plan import auto_paradigm

    config = preset_config("qwen3-30b-a3b")
    assert auto_paradigm(config, qwen3_rates(cpu_per_token=3e-6))[0] == "hybrid"
    broken = qwen3_rates()
    del broken["shapes"][key_of("qwen3-30b-a3b")]["cpu_forward_s"]  # an entry of the shape missing
    no_gpu = {k: v for k, v in qwen3_rates().items() if k != "h2d_gbps"}
    for rates in (broken, no_gpu, {**qwen3_rates(), "shapes": {}}):
        assert auto_paradigm(config, rates) is None
    assert auto_paradigm(object(), qwen3_rates()) is None


def test_hybrid_prices_the_link_at_its_rate_beside_the_cpu_part(monkeypatch):
    """The copies run slower while the CPU part reads DRAM beside them: the link-bound hybrid prediction grows by
    the rate's share, offload's (the link alone) does not move."""
    from moecc.bench import plan

    rates = qwen3_rates(cpu_per_token=3e-6)
    shared = predict("qwen3-30b-a3b", 2048, rates, 48)
    monkeypatch.setattr(plan, "HYBRID_LINK_SHARE", 1.0)
    alone = predict("qwen3-30b-a3b", 2048, rates, 48)
    assert shared["offload"] == alone["offload"] and shared["hybrid"] > alone["hybrid"]


def test_gpu_timings_run_on_any_device():
    """The GPU measurements are device-generic, so the code runs here on the CPU with the tiny preset."""
    cpu = torch.device("cpu")
    forward, backward = rates_module.gpu_expert_passes(rates_module.moe_shape(preset_config("tiny")), [16, 64], cpu)
    assert len(forward) == len(backward) == 2 and min(forward + backward) > 0
    for experts in (False, True):
        layer, rest = rates_module.per_layer_and_rest("tiny", cpu, [16, 64], experts=experts)
        assert len(layer) == len(rest) == 2 and min(layer + rest) >= 0


def test_gpu_timings_fall_back_to_fewer_loads_and_layers_when_they_run_out_of_memory(monkeypatch):
    """Every load is timed, models 7 layers apart; where that runs out of memory, the first two loads, then 3
    layers apart. Each part falls back on its own, keeps what ran, and frees the failed attempt's models."""
    shape = rates_module.moe_shape(preset_config("tiny"))
    every = rates_module.token_counts(shape, rates_module.GPU_LOADS)
    assert len(every) == 3
    timed, alive = [], []
    monkeypatch.setattr(rates_module, "gpu_expert_passes", lambda shape, tokens, device: ([1.0] * len(tokens),) * 2)

    class Model:  # stands for the models a failed step built; the retry must not find it alive
        pass

    def per_layer_and_rest(preset, device, tokens, experts, apart):
        timed.append((experts, len(tokens), apart))
        assert all(ref() is None for ref in alive), "a failed attempt's models are still alive"
        model = Model()
        alive.append(weakref.ref(model))
        if experts and apart == 7:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")  # not OOM's type
        return [2.0] * len(tokens), [3.0] * len(tokens)

    monkeypatch.setattr(rates_module, "per_layer_and_rest", per_layer_and_rest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # falling back is silent
        rates = rates_module._gpu_shape_rates("tiny", shape, torch.device("cpu"))
    assert timed == [(False, 3, 7), (True, 3, 7), (True, 2, 7), (True, 2, 3)]
    assert all(ref() is None for ref in alive)
    assert rates["gpu_tokens"] == every and rates["gpu_layer_tokens"] == every[:2]
    assert rates["gpu_attention_layer_s"] == [2.0] * 3 and rates["gpu_layer_s"] == [2.0] * 2
    # Another error (not memory) is not retried: that part is left out with a warning, the others kept
    monkeypatch.setattr(rates_module, "per_layer_and_rest",
                        lambda *args, **kwargs: (_ for _ in ()).throw(ValueError("no such layer")))
    with pytest.warns(UserWarning, match="could not run \\(no such layer\\)"):
        rates = rates_module._gpu_shape_rates("tiny", shape, torch.device("cpu"))
    assert rates == {}


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(rates_cache, "CACHE", tmp_path / "rates.json")


def test_checkpointing_costs_a_forward_again_but_not_the_cpu_experts():
    rates = qwen3_rates()
    plain = predict("qwen3-30b-a3b", 2048, rates)
    again = predict("qwen3-30b-a3b", 2048, rates, checkpointing=True)
    layers = preset_config("qwen3-30b-a3b").num_hidden_layers
    # co-compute: only the GPU part of each layer grows (by a third); the CPU experts are replayed, not rerun
    attention = rates["shapes"][key_of("qwen3-30b-a3b")]["gpu_attention_layer_s"][1]
    assert again["cocompute"] - plain["cocompute"] == pytest.approx(layers * attention / 3, rel=1e-6)
    assert again["gpu"] == pytest.approx(plain["gpu"] * 4 / 3)
    # offload: PCIe (55 GB/s) is the bottleneck, so the attention again hides behind the copies (the experts do not
    # run again: no shared expert after them); the step grows only where the attention is exposed: the first
    # layer's forward (a sixth more) and the backward of the two layers resident at the turn (a sixth more each)
    assert again["offload"] == pytest.approx(plain["offload"] + attention / 2, rel=1e-9)


@pytest.mark.parametrize("cpu_per_token", [3e-6, 3e-5, 3e-4])
def test_hybrid_prediction_splits_where_it_pays_and_falls_back_where_not(cpu_per_token):
    """Qwen3 shape: with a fast CPU the split puts part of each layer on the CPU and beats offload; with a CPU
    too slow to help it takes (nearly) everything to the GPU and predicts no worse than offload's streaming
    plus the per-pass cost of the few experts left to the CPU."""
    from moecc.bench.plan import hybrid_plan

    rates = qwen3_rates(cpu_fixed=0.002, cpu_per_token=cpu_per_token)
    for tokens in (512, 2048, 8192):
        times = predict("qwen3-30b-a3b", tokens, rates, layers=4)
        split = hybrid_plan("qwen3-30b-a3b", tokens, rates, layers=4)
        assert set(split) == {"forward", "backward"}
        forward = split["forward"]
        assert 0 <= forward["gpu_experts"] <= forward["routed_experts"] <= 128
        if cpu_per_token == 3e-6:
            assert forward["side"] == "both" and times["hybrid"] < times["offload"]
        if cpu_per_token == 3e-4:
            assert forward["gpu_experts"] >= 0.9 * forward["routed_experts"]
            assert times["hybrid"] <= times["offload"] * 1.15
