"""A loan's prompt geometry (DESIGN §5 step 3), decided in one place: the transaction asks it
with the memory its release freed, the forecast (engine.runtime.workload) with the memory a
release would free. Pure: the caller reads the engine and passes the numbers."""

from __future__ import annotations

from engine.memory.plan_types import ModelCosts, PlanOptions, PromptGeometry, StartupPlan
from engine.memory.planner import plan_loan

STARTUP, REPEAT = "startup", "repeat"  # the two loans (engine.loan.transaction.admission)
RETAINED, REPLANNED = "retained startup geometry", "re-planned"  # how a geometry was chosen


def loan_geometry(plan: StartupPlan, free_bytes: int, costs: ModelCosts, options: PlanOptions,
                  kind: str, retained: PromptGeometry | None, n_lendable: int,
                  n_growable: int) -> tuple[PromptGeometry, str]:
    """The prompt geometry of a `kind` loan and how it was chosen (RETAINED or REPLANNED).

    A repeat loan reuses the `retained` startup geometry (None: not kept, or
    STRATA_PREFILL_RETAIN_STARTUP_CHUNK off) when its lent slots fit the cache: the
    `n_lendable` slots it may lend plus the `n_growable` it can grow by (a repeat loan may
    release fewer regions than the startup loan did); otherwise the loan re-plans with the
    `free_bytes` the ledger has once the loan's regions are released."""
    if kind == REPEAT and retained is not None and (
            not retained.borrowed or retained.n_lent_slots <= n_lendable + n_growable):
        return retained, RETAINED
    return plan_loan(plan, free_bytes, costs, options), REPLANNED


def growable_slots(mapped_bytes: int, used_bytes: int, free_bytes: int, blob_bytes: int) -> int:
    """Slots an expert cache region (`mapped_bytes` mapped, `used_bytes` used) can grow by: its
    last segment's tail and the ledger's `free_bytes`."""
    return (mapped_bytes - used_bytes + free_bytes) // blob_bytes
