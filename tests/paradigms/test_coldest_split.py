"""The coldest-to-the-CPU split policy: its placement, training like HF + PEFT under it, and its selection by name."""
from __future__ import annotations

import pytest
import torch

import moecc
from moecc.paradigms.coldest_split import ColdestToCpu
from moecc.paradigms.split_policies import split_policy

from ..parity import build_pair, lora_config
from .test_hybrid import train_two_steps_like_hf_peft


class _Layer:
    index = 0


def test_the_coldest_routed_experts_go_to_the_cpu_up_to_the_share():
    policy = ColdestToCpu(0.5)
    policy._expert_bytes = [100]
    counts = [5, 0, 1, 9, 2, 7]  # routed: 0, 2, 3, 4, 5; half of their bytes: 2.5 experts -> the two coldest
    assert policy.forward(_Layer(), counts, set(), set()) == (0, 3, 5)
    assert ColdestToCpu(0.0).forward(_Layer(), counts, set(), set()) == (0, 2, 3, 4, 5)
    assert ColdestToCpu(1.0).forward(_Layer(), counts, set(), set()) == ()
    assert policy.backward(_Layer(), counts, (0, 3, 5), set()) == (0, 3, 5)


def test_names_select_policies_and_bad_ones_are_refused():
    assert split_policy("coldest:0.3").share == 0.3 and split_policy("coldest").share == 0.25
    assert split_policy("planned").name == "planned"
    with pytest.raises(moecc.MoeccError, match="split_policy='fastest'.*planned, coldest"):
        split_policy("fastest")
    with pytest.raises(moecc.MoeccError, match=r"byte share must be in \[0, 1\], got 2.0"):
        split_policy("coldest:2")


def test_hybrid_under_the_coldest_policy_trains_like_hf_peft():
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid",
                           moecc_options={"split_policy": "coldest:0.5"})
    assert engine.moecc.engine.split.name == "coldest"
    train_two_steps_like_hf_peft("qwen3_moe", engine)
    metrics = engine.moecc.engine.metrics_since_reset()
    assert metrics["cpu_pairs"] > 0 and metrics["gpu_pairs"] > 0 and metrics["cpu_pairs"] < metrics["gpu_pairs"]
