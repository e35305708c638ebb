"""`strata plan`: the startup memory plan of a model on a device, as a table.

It runs the same guards as `strata run` (`engine.build.device.plan_device`): a combination `run`
refuses is refused here, with the same one line and exit code 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.build.device import plan_device
from engine.cli.options import add_engine_args, engine_options, loan_flags
from engine.costs import Shapes
from engine.devices import deferred_regions, resolve_device
from engine.memory.planner import format_plan_table
from engine.memory.sizes import format_mib
from engine.model.loader import load_model
from engine.synth.demo import resolve_model
from engine.synth.model import PRESETS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the startup memory plan (regions, MiB, chunk / ring)")
    add_engine_args(p)
    p.set_defaults(func=run)


def plan_text(args: argparse.Namespace) -> str:
    """The budget table for the model and device in `args`; allocates nothing. FlagError
    when the guards refuse the options and STRATA_PREFILL_* flags (as `strata run` does)."""
    options, flags = engine_options(args), loan_flags()
    shapes, name = _shapes(options.model)
    planned = plan_device(options, flags, shapes)
    costs, plan = planned.costs, planned.plan
    capacity, seg = planned.backend.capacity_bytes, plan.segment_bytes
    device = resolve_device(options.device)
    if options.vram_limit:
        device += f" (--vram-limit {options.vram_limit})"
    hp = shapes.hp
    head = [
        (
            f"model   {name}: {hp.n_layer} layers x {hp.n_expert} experts, expert blob "
            f"{costs.expert_blob_bytes:,} B ({hp.n_layer * hp.n_expert} blobs, "
            f"{format_mib(costs.cache_bytes(costs.n_blobs))} MiB)"
        ),
        (
            f"device  {device} = {format_mib(capacity)} MiB in {plan.n_segments} segments of "
            f"{format_mib(seg)} MiB"
        ),
        *budget_lines(planned.backend),
        f"loan    deferred at startup: {', '.join(sorted(deferred_regions(flags, options))) or 'none'}",
        f"costs   dense {format_mib(costs.dense_bytes)}, kv {format_mib(costs.kv_bytes)}, "
        + ", ".join(f"{k} {format_mib(v)}" for k, v in costs.decode_only_bytes().items())
        + f" MiB; {costs.act_bytes_per_token:,} B of activations per prompt token",
        "",
    ]
    return "\n".join(head) + format_plan_table(plan)


def budget_lines(backend: object) -> list[str]:
    """On CUDA, how the whole-process limit was divided (engine/memory/budget.py)."""
    budget = getattr(backend, "budget", None)
    return [] if budget is None else [f"budget  {budget.line()}"]


def _shapes(model: str) -> tuple[Shapes, str]:
    """Shapes of a preset straight from its spec (no 17 GB file needed), else of the file."""
    if model in PRESETS and not Path(model).exists():
        return Shapes.of_spec(PRESETS[model]), f"preset {model}"
    m = load_model(resolve_model(model), build=False)
    return Shapes.of(m), m.path.name


def run(args: argparse.Namespace) -> int:
    print(plan_text(args))
    return 0
