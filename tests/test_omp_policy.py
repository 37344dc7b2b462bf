"""moecc asks torch's OpenMP threads to sleep instead of spin when it can, and says so when it cannot."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, warnings
{imports}
from moecc import _ops
from moecc.experts.native import NativeExperts
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    NativeExperts(_ops.best_isa())
print(os.environ.get("OMP_WAIT_POLICY"), any("OMP_WAIT_POLICY" in str(w.message) for w in caught))
"""


def _run(imports: str, policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(imports=imports)], env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("imports,policy,expected", [
    ("import moecc\nimport torch", None, "PASSIVE False"),  # moecc first: it sets the policy, no warning
    ("import torch\nimport moecc", None, "None True"),  # too late to set it: a warning that says what to do
    ("import torch\nimport moecc", "ACTIVE", "ACTIVE False"),  # the user's choice stands, silently
])
def test_wait_policy(imports, policy, expected):
    assert _run(imports, policy) == expected
