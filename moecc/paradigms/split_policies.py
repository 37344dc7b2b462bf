"""The split policies ``MoeccConfig.split_policy`` names: ``"planned"`` (the default) or ``"coldest[:share]"``.

A new policy is one module implementing ``moecc.paradigms.split_policy.SplitPolicy`` and one entry here.
"""
from __future__ import annotations

from typing import Callable

from ..errors import MoeccError
from .coldest_split import ColdestToCpu
from .split_policy import PlannedSplit, SplitPolicy

# name -> a new policy from the text after "name:" ("" when there is none)
POLICIES: dict[str, Callable[[str], SplitPolicy]] = {
    "planned": lambda arg: PlannedSplit(),
    "coldest": lambda arg: ColdestToCpu(float(arg)) if arg else ColdestToCpu(),
}


def split_policy(setting: str | SplitPolicy) -> SplitPolicy:
    """A new policy for one engine from ``setting`` (``"name"`` or ``"name:argument"``), or ``setting`` itself
    where it is a policy object already (tests, A/B runs: ``FixedSplit(rule)``)."""
    if isinstance(setting, SplitPolicy):
        return setting
    name, _, arg = str(setting).partition(":")
    if name not in POLICIES:
        raise MoeccError(f"split_policy={setting!r} is not a split policy; choose one of {', '.join(POLICIES)} "
                         "('coldest' takes a byte share, e.g. 'coldest:0.25')")
    try:
        return POLICIES[name](arg)
    except ValueError as error:
        raise MoeccError(f"split_policy={setting!r}: {error}") from None


def policy_name(setting: str | SplitPolicy) -> str:
    """``setting`` as text (a policy object by its name), for ``moecc_config.json`` and the summary line."""
    return setting if isinstance(setting, str) else setting.name
