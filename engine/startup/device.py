"""What startup decides before it allocates: the device, what each item costs, the guards on
the options, the flags and the device's facts, and the memory plan. `strata plan` prints it;
`build_runtime` allocates it — one planning path for both."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from engine.backend import make_backend
from engine.backend.base import Backend, DeviceTraits
from engine.config import EngineOptions, LoanFlags
from engine.devices import (
    dense_quantized,
    device_traits,
    resolve_device,
    segment_bytes,
    sim_device,
    vram_limit_bytes,
)
from engine.errors import FlagError
from engine.kernels.warmup import Progress, warm_up
from engine.loan.deferral import deferred_regions
from engine.loan.guards import validate
from engine.memory.costs import Shapes, model_costs
from engine.memory.plan_types import ModelCosts, PlanOptions, StartupPlan
from engine.memory.planner import fit_mtp_experts, plan_startup
from engine.memory.sizes import MiB


@dataclass(frozen=True)
class DevicePlan:
    """The device, what each planned item costs, the planner's options and the plan;
    `quantized`: the dense linear weights stay in their blocks (`--dense`)."""

    backend: Backend
    costs: ModelCosts
    plan_options: PlanOptions
    plan: StartupPlan
    quantized: bool = False


def plan_device(options: EngineOptions, flags: LoanFlags, shapes: Shapes,
                backend: Backend | None = None, compiling: Progress | None = None) -> DevicePlan:
    """Open the device, run the guards on the options, the flags and the device's facts
    (capacity, segment), then plan memory. Every refusal is one FlagError listing them all,
    raised before anything is allocated or deferred. `backend`: a device opened by an earlier
    call with the same options (`strata plan` plans it again with other flags); `compiling`
    hears the CUDA kernel modules load (engine/kernels/warmup.py)."""
    device = resolve_device(options.device)
    traits = device_traits(device) if backend is None else backend.traits
    quantized = dense_quantized(traits, options)
    costs = model_costs(shapes, options, traits.weight_bytes, gpu=traits.gpu, quant=quantized)
    reserve = options.vram_reserve_mib * MiB
    limit = vram_limit_bytes(options)
    if backend is None:
        # the model's kernels load up front
        warm = functools.partial(warm_up, shapes.every_qtype, progress=compiling)
        backend = make_backend(sim_device(device, costs, reserve, limit), limit,
                               elastic=options.vram_elastic, warm_up=warm)
    capacity = backend.capacity_bytes
    seg = segment_bytes(options, capacity)
    violations = validate(options, flags, traits, shapes.has_mtp, shapes.hp.has_output,
                          segment_bytes=seg, capacity_bytes=capacity)
    if violations:
        raise FlagError(violations)
    plan_options = plan_options_for(options, flags, reserve, seg, traits)
    costs = fit_mtp_experts(capacity, costs, plan_options)
    return DevicePlan(backend, costs, plan_options, plan_startup(capacity, costs, plan_options),
                      quantized)


def plan_options_for(options: EngineOptions, flags: LoanFlags, reserve_bytes: int,
                     segment_bytes: int, device: DeviceTraits) -> PlanOptions:
    """The planner's options on a device with these traits (its ring's layers of experts)."""
    return PlanOptions(
        ring_layers=device.ring_layers,
        expert_cache=options.expert_cache, prefill=options.prefill,
        deferred=deferred_regions(flags, options), borrow=not options.no_borrow,
        reserve_bytes=reserve_bytes, segment_bytes=segment_bytes,
        mtp_expert_slots=options.mtp_experts,
    )
