"""The whole-process device budget: how `--vram-limit N` (the process as NVML counts it) is
divided before the planner runs. Pure arithmetic; the CUDA backend measures the inputs.

    limit = outside + margin + workspace + ledger capacity (+ < one granule of rounding)

- `outside`: what the process holds that neither the ledger nor CuPy's pool accounts for,
  measured after a warm-up: the CUDA context (~520 MiB on the H200), cuBLAS's handle and
  workspace, the kernel modules loaded so far, memory another engine of this process still holds.
- `margin`: what loads after the measure (kernels of the model's own shapes, captured graphs,
  local memory a kernel makes the driver grow); the pool's limit shrinks by whatever growth a
  later measure finds, so the margin only has to cover the time between two measures.
- `workspace`: CuPy's memory pool (decode temporaries, cuBLAS calls, what a prompt chunk's
  arena spills); the pool's limit is `inside - ledger bytes`, so it takes what the ledger does
  not hold.
- `capacity`: what the planner and the ledger divide into regions.

Without `--vram-limit` the limit is what the process holds outside plus what the device has
free, less `device_margin` (left for other processes).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import DeviceError
from engine.memory.sizes import MiB, format_mib

DEVICE_MARGIN_BYTES = 512 * MiB  # without --vram-limit: left free on the device for others
GROWTH_MARGIN_BYTES = 256 * MiB  # what loads after the measure (see the module docstring)
MIN_WORKSPACE_BYTES = 768 * MiB  # CuPy's pool: at least this, else an eighth of the inside


@dataclass(frozen=True)
class ProcessBudget:
    """A limit on the whole process, divided (see the module docstring). Bytes throughout."""

    limit_bytes: int  # the whole process, as NVML counts it
    outside_bytes: int  # measured: context, cuBLAS, kernel modules, others' leftovers
    margin_bytes: int  # for what loads after the measure
    inside_bytes: int  # ledger + pool may hold this: limit - outside - margin, or less if not free
    workspace_bytes: int  # kept for CuPy's pool
    capacity_bytes: int  # the ledger's, a multiple of the mapping granularity

    def pool_limit_bytes(self, ledger_bytes: int, outside_bytes: int) -> int:
        """CuPy's pool limit while the ledger holds `ledger_bytes` and the process holds
        `outside_bytes` outside both: what is left of the limit, never more than the inside.
        At least 1 (CuPy reads 0 as "no limit")."""
        inside = min(self.inside_bytes, self.limit_bytes - self.margin_bytes - outside_bytes)
        return max(1, inside - ledger_bytes)

    def line(self) -> str:
        """One line for people: the limit and its parts, in MiB."""
        return (
            f"vram limit {format_mib(self.limit_bytes)} MiB = ledger "
            f"{format_mib(self.capacity_bytes)} + workspace {format_mib(self.workspace_bytes)} "
            f"+ outside the ledger {format_mib(self.outside_bytes)} (CUDA context, cuBLAS, "
            f"kernels) + margin {format_mib(self.margin_bytes)} MiB"
        )


def plan_budget(
    limit_bytes: int | None,
    free_bytes: int,
    outside_bytes: int,
    *,
    granularity_bytes: int,
    margin_bytes: int = GROWTH_MARGIN_BYTES,
    device_margin_bytes: int = DEVICE_MARGIN_BYTES,
    workspace_bytes: int | None = None,
) -> ProcessBudget:
    """Divide `limit_bytes` (None: no --vram-limit) given the device's `free_bytes` and the
    process's `outside_bytes`, both measured after the warm-up. The inside is also capped by
    what is free (less `device_margin_bytes`), so a limit above the card's free memory plans
    only what can be had. DeviceError, one line, when nothing is left for the ledger."""
    assert free_bytes >= 0 and outside_bytes >= 0 and granularity_bytes > 0
    given = limit_bytes is not None
    if limit_bytes is None:
        limit_bytes = outside_bytes + free_bytes - device_margin_bytes
    inside = min(limit_bytes - outside_bytes, free_bytes - device_margin_bytes) - margin_bytes
    if inside <= 0:
        if given and limit_bytes - outside_bytes - margin_bytes <= 0:
            raise DeviceError(
                f"--vram-limit {format_mib(limit_bytes)} MiB leaves nothing to plan: the process "
                f"holds {format_mib(outside_bytes)} MiB outside the ledger (CUDA context, cuBLAS, "
                f"kernels) and keeps a {format_mib(margin_bytes)} MiB margin; raise --vram-limit"
            )
        raise DeviceError(
            f"{format_mib(free_bytes)} MiB free on the device, less a "
            f"{format_mib(device_margin_bytes + margin_bytes)} MiB margin: nothing left to plan"
        )
    if workspace_bytes is None:
        workspace_bytes = min(inside // 2, max(MIN_WORKSPACE_BYTES, inside // 8))
    capacity = (inside - workspace_bytes) // granularity_bytes * granularity_bytes
    if capacity <= 0:
        what = f"--vram-limit {format_mib(limit_bytes)} MiB" if given else "the free memory"
        raise DeviceError(
            f"{what}: after the {format_mib(workspace_bytes)} MiB workspace no "
            f"{format_mib(granularity_bytes)} MiB granule is left for the ledger"
            + ("; raise --vram-limit" if given else "")
        )
    return ProcessBudget(limit_bytes, outside_bytes, margin_bytes, inside, workspace_bytes,
                         capacity)
