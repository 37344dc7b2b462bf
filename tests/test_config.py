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
    ("MOECC_OFFLOAD_CACHE_GB", "-2", "offload_cache_gb must be >= 0"),
    ("MOECC_OFFLOAD_SLOTS", "two", "whole number of layers"),
    ("MOECC_OFFLOAD_SLOTS", "0", "offload_slots must be >= 1"),
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
