"""The moecc command line."""
from moecc import cli


def test_info_reports_cpu_isa_and_versions(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for field in ("kernel_isa", "cpu_features", "threads", "torch", "transformers", "peft", "gpu"):
        assert field in out
    details = cli.info()
    assert details["kernel_isa"] in ("amx", "avx512_bf16", "portable")
