"""The staging engine: how s5cmd is driven to fill a staging pass within a byte budget.

Read in this order: :mod:`.options` (what the engine reports; it is told a
:class:`~s5loader.config.StagingOptions`), :mod:`.schedule` (which positions each call takes),
:mod:`.plan` (command lines of one call), :mod:`.budget` (reservations, releases, the deadlock
guard), :mod:`.calls` (s5cmd processes, the select loop, routing and attribution of output
lines), :mod:`.endings` (what becomes of a call that ends), :mod:`.retry` (backoff, give-up,
error policy), :mod:`.watchdog` (stalled calls, hung copies), :mod:`.side` (keys no command
file can carry) and :mod:`.stager`, which only orchestrates them.
"""

from .callplan import CallPlan, plan_call
from .stager import Stager
from .stats import Stats

__all__ = ["CallPlan", "Stager", "Stats", "plan_call"]
