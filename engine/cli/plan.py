"""`strata plan`: the startup memory plan of a model on a device, as a table."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli.options import add_engine_args, engine_options, loan_flags
from engine.costs import Shapes, model_costs
from engine.devices import (
    default_segment_bytes,
    default_sim_bytes,
    deferred_regions,
    resolve_device,
    weight_bytes,
)
from engine.memory.planner import format_plan_table, plan_startup
from engine.memory.sizes import MiB, format_mib, parse_size
from engine.model.loader import load_model
from engine.runtime import Runtime
from engine.synth.demo import resolve_model
from engine.synth.model import PRESETS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the startup memory plan (regions, MiB, chunk / ring)")
    add_engine_args(p)
    p.set_defaults(func=run)


def plan_text(args: argparse.Namespace) -> str:
    """The budget table for the model and device in `args`; allocates nothing."""
    options, flags = engine_options(args), loan_flags()
    shapes, name = _shapes(options.model)
    reserve = options.vram_reserve_mib * MiB
    device = resolve_device(options.device)
    costs = model_costs(shapes, options, weight_bytes(device), gpu=device.startswith("cuda"))
    if device == "sim":
        capacity = default_sim_bytes(costs, reserve)
    else:
        from engine.backend import make_backend

        limit = parse_size(options.vram_limit, what="--vram-limit") if options.vram_limit else None
        capacity = make_backend(device, limit).capacity_bytes
    seg = options.vram_segment_mib * MiB if options.vram_segment_mib else default_segment_bytes(capacity)
    opts = Runtime.plan_options_for(options, flags, reserve, seg, device)
    plan = plan_startup(capacity, costs, opts)
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
        f"loan    deferred at startup: {', '.join(sorted(deferred_regions(flags, options))) or 'none'}",
        f"costs   dense {format_mib(costs.dense_bytes)}, kv {format_mib(costs.kv_bytes)}, "
        + ", ".join(f"{k} {format_mib(v)}" for k, v in costs.decode_only_bytes().items())
        + f" MiB; {costs.act_bytes_per_token:,} B of activations per prompt token",
        "",
    ]
    return "\n".join(head) + format_plan_table(plan)


def _shapes(model: str) -> tuple[Shapes, str]:
    """Shapes of a preset straight from its spec (no 17 GB file needed), else of the file."""
    if model in PRESETS and not Path(model).exists():
        return Shapes.of_spec(PRESETS[model]), f"preset {model}"
    m = load_model(resolve_model(model), build=False)
    return Shapes.of(m), m.path.name


def run(args: argparse.Namespace) -> int:
    print(plan_text(args))
    return 0
