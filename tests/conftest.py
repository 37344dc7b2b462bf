"""Set-up for the whole test run: moecc is imported before torch, as users are told to, so torch's OpenMP threads sleep
between ops (moecc sets OMP_WAIT_POLICY=PASSIVE) and the suite runs the kernels as they run in use."""
import moecc  # noqa: F401
import pytest

# The e2e tests of tests/bench (pyproject.toml's markers): each runs a benchmarks/ script or moecc bench (whose cases
# run in child processes) end to end. Elsewhere they carry @pytest.mark.e2e.
BENCH_E2E = {
    "test_bench.py": {"test_bench_writes_table_json_and_plots", "test_paradigm_that_cannot_run_is_recorded",
                      "test_hf_offload_without_cuda_is_an_error_row_end_to_end",
                      "test_isolated_case_turns_a_crashed_process_into_error_rows"},
    "test_bench_cpu_experts.py": {"test_bench_writes_its_table_with_the_command_and_each_cpus_peak"},
    "test_bench_cpu_subset.py": {"test_bench_cpu_subset_times_each_subset_and_the_whole_layer",
                                 "test_bench_cpu_subset_phases_name_each_phase_and_the_products_parts"},
    "test_hybrid_modes_ab.py": {"test_runs_interleaved_on_the_cpu_device"},
    "test_kernel_phases.py": {"test_kernel_phases_prints_every_phase_of_both_passes",
                              "test_kernel_phases_names_a_bad_shape"},
    "test_profile_step.py": {"test_profile_step_reports_each_token_count"},
    "test_soak_script.py": {"test_soak_script_writes_table_samples_and_plot",
                            "test_soak_script_rejects_a_warm_up_that_leaves_no_samples"},
    "test_sweep_cpu_experts.py": {"test_sweep_times_every_setting_and_writes_its_table",
                                  "test_a_setting_out_of_range_is_refused_before_timing"},
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    bench = config.rootpath / "tests" / "bench"
    for item in items:
        names = BENCH_E2E.get(item.path.name) if item.path.parent == bench else None
        if not names:
            continue
        missing = sorted(name for name in names if not hasattr(item.module, name))
        if missing:
            raise pytest.UsageError(f"tests/conftest.py's BENCH_E2E names tests {item.path.name} lacks: {missing}")
        if item.originalname in names:
            item.add_marker(pytest.mark.e2e)
