"""Set-up for the whole test run: moecc is imported before torch, as users are told to, so torch's OpenMP threads sleep
between ops (moecc sets OMP_WAIT_POLICY=PASSIVE) and the suite runs the kernels as they run in use."""
import moecc  # noqa: F401
