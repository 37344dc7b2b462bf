"""Engine options and their MOECC_* environment variables."""
import pytest

from moecc import MoeccConfig


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("MOECC_NUM_THREADS", "3")
    monkeypatch.setenv("MOECC_PIN_THREADS", "no")
    monkeypatch.setenv("MOECC_OFFLOAD_CACHE_GB", "1.5")
    monkeypatch.setenv("MOECC_OFFLOAD_SLOTS", "5")
    config = MoeccConfig.from_env()
    assert config.num_threads == 3 and config.pin_threads is False and config.offload_cache_gb == 1.5
    assert config.offload_slots == 5


@pytest.mark.parametrize("name,value,match", [
    ("MOECC_NUM_THREADS", "abc", "whole number"),
    ("MOECC_PIN_THREADS", "maybe", "1/true/yes"),
    ("MOECC_BACKEND", "turbo", "unknown moecc backend"),
    ("MOECC_OFFLOAD_CACHE_GB", "lots", "not a number of GB"),
    ("MOECC_OFFLOAD_CACHE_GB", "-2", r"MOECC_OFFLOAD_CACHE_GB \(offload_cache_gb\) must be a number of GB >= 0"),
    ("MOECC_OFFLOAD_SLOTS", "two", "whole number of layers"),
    ("MOECC_OFFLOAD_SLOTS", "0", "MOECC_OFFLOAD_SLOTS='0' is not a whole number of layers from 1 to 1024"),
])
def test_bad_environment_values_are_named(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        MoeccConfig.from_env()


def test_isa_option(monkeypatch):
    monkeypatch.setenv("MOECC_ISA", "portable")
    assert MoeccConfig.from_env().isa == "portable"
    monkeypatch.setenv("MOECC_ISA", "neon")
    with pytest.raises(ValueError, match="unknown ISA 'neon'"):
        MoeccConfig.from_env()


def test_expert_format_options(monkeypatch):
    assert MoeccConfig().expert_format == "auto" and MoeccConfig().int4_group_size == 128
    assert MoeccConfig(expert_format=" INT4 ").expert_format == "int4"
    monkeypatch.setenv("MOECC_EXPERT_FORMAT", "fp8")
    monkeypatch.setenv("MOECC_INT4_GROUP", "64")
    config = MoeccConfig.from_env()
    assert config.expert_format == "fp8" and config.int4_group_size == 64


@pytest.mark.parametrize("kwargs,match", [
    (dict(expert_format="int3"), "unknown expert_format 'int3'; choose one of auto, bf16, fp8, int8, int4, mxfp4"),
    (dict(expert_format=None), "unknown expert_format None"),
    (dict(int4_group_size=48), "int4_group_size=48 is not supported; choose one of 32, 64, 128"),
    (dict(int4_group_size=True), "int4_group_size=True"),
])
def test_bad_expert_format_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoeccConfig(**kwargs)


@pytest.mark.parametrize("name,value,match", [
    ("MOECC_EXPERT_FORMAT", "nf4", "unknown expert_format 'nf4'"),
    ("MOECC_INT4_GROUP", "big", "MOECC_INT4_GROUP='big' is not a whole number"),
    ("MOECC_INT4_GROUP", "16", "int4_group_size=16 is not supported"),
])
def test_bad_expert_format_variables_are_named(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        MoeccConfig.from_env()
