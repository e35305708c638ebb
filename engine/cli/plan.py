"""`strata plan`: the startup memory plan of a model on a device, as a table; with
`--prompt-tokens N`, the forecast of prefilling N tokens with the loan and without it.

It runs the same guards as `strata run` (`engine.startup.device.plan_device`): a combination `run`
refuses is refused here, with the same one line and exit code 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from engine.cli.options import add_engine_args, engine_options, loan_flags
from engine.config import EngineOptions, LoanFlags
from engine.devices import hardware_name, resolve_device
from engine.errors import FlagError, StrataError
from engine.experts.profile import ExpertProfile
from engine.gguf.type_mix import layer_ranges
from engine.loan.deferral import deferred_regions
from engine.loan.forecast import (
    Forecast,
    RatesError,
    Workload,
    format_forecasts,
    load_rates,
    rates_path,
    routing_odds,
    workload,
)
from engine.memory.costs import Shapes
from engine.memory.planner import format_plan_table, plan_loan
from engine.memory.sizes import format_mib
from engine.model.loader import load_model
from engine.prompt.path import shrink_geometry
from engine.startup.device import DevicePlan, plan_device
from engine.startup.profile_record import cached_profile
from engine.synth.demo import cache_dir, preset_path, resolve_model
from engine.synth.model import PRESETS

# The loan's forecast when the STRATA_PREFILL_* flags leave it off: every flag on.
ALL_ON = LoanFlags(elastic_loan=True, mtp_loan=True, head_loan=True, retain_startup_chunk=True,
                   repeat_loan=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the startup memory plan (regions, MiB, chunk / ring)")
    add_engine_args(p)
    p.add_argument("--prompt-tokens", type=int, metavar="N",
                   help="also forecast prefilling N fresh tokens, loan off and on")
    p.set_defaults(func=run)


def plan_text(options: EngineOptions, flags: LoanFlags, shapes: Shapes, name: str,
              planned: DevicePlan) -> str:
    """The budget table of `planned` (plan_device of the model `name` with these options and
    flags); allocates nothing."""
    costs, plan = planned.costs, planned.plan
    capacity, seg = planned.backend.capacity_bytes, plan.segment_bytes
    device = resolve_device(options.device)
    if options.vram_limit:
        device += f" (--vram-limit {options.vram_limit})"
    hp = shapes.hp
    head = [
        (
            f"model   {name}: {hp.n_moe_layer} layers x {hp.n_expert} experts{hp.resident_ffn()}, "
            f"expert blob {costs.expert_blob_bytes:,} B ({hp.n_moe_layer * hp.n_expert} blobs, "
            f"{format_mib(costs.cache_bytes(costs.n_blobs))} MiB)"
        ),
        *_blob_lines(shapes),
        (
            f"device  {device} = {format_mib(capacity)} MiB in {plan.n_segments} segments of "
            f"{format_mib(seg)} MiB"
        ),
        *budget_lines(planned.backend),
        f"loan    deferred at startup: {', '.join(sorted(deferred_regions(flags, options))) or 'none'}",
        f"costs   dense {format_mib(costs.dense_bytes)}, kv {format_mib(costs.kv_bytes)}, "
        + ", ".join(f"{k} {format_mib(v)}" for k, v in costs.decode_only_bytes().items() if v)
        + f" MiB; {costs.act_bytes_per_token:,} B of activations per prompt token"
        + ("; the draft head is the native head" if options.mtp and not costs.draft_head_bytes
           and costs.mtp_expert_bytes else ""),
        "",
    ]
    return "\n".join(head) + format_plan_table(plan)


def budget_lines(backend: object) -> list[str]:
    """On CUDA, how the whole-process limit was divided (engine/memory/budget.py)."""
    budget = getattr(backend, "budget", None)
    return [] if budget is None else [f"budget  {budget.line()}"]


def _shapes(model: str) -> tuple[Shapes, str, ExpertProfile | None]:
    """Shapes of a preset straight from its spec (no 17 GB file needed), else of the file,
    with the calibration profile an earlier run cached for it (None: none yet)."""
    if model in PRESETS and not Path(model).exists():
        return Shapes.of_spec(PRESETS[model]), f"preset {model}", None
    m = load_model(resolve_model(model), build=False)
    return Shapes.of(m), m.path.name, cached_profile(m)


def forecast_text(n: int, options: EngineOptions, flags: LoanFlags, shapes: Shapes,
                  profile: ExpertProfile | None, off: DevicePlan) -> str:
    """The forecast of prefilling `n` fresh tokens: without a loan, with the startup loan and
    with a repeat loan (the STRATA_PREFILL_* flags, or every flag on when they leave the loan
    off), from this device's rates (engine.loan.forecast); `off` is the plan with `flags`."""
    if options.expert_profile:
        profile = ExpertProfile.load(options.expert_profile, n_layer=shapes.hp.n_layer,
                                     n_expert=shapes.hp.n_expert)
    hp = shapes.hp
    odds = routing_odds(profile, hp.n_layer, hp.n_expert, hp.n_expert_used)
    on_flags = flags if flags.elastic_loan else ALL_ON
    columns: list[tuple[str, Forecast | str]] = []
    path = rates_path(_model_path(options.model), options.expert_profile, cache_dir())
    device = hardware_name(off.backend.device_index)
    try:
        rates = load_rates(path, device)
    except RatesError as e:
        raise StrataError(str(e)) from None
    columns.append(("loan off", rates.forecast(_workload(None, n, off, shapes, odds))))
    refused = []
    try:
        on = plan_device(options, on_flags, shapes, backend=off.backend)
    except FlagError as e:
        columns.append(("loan", "refused"))
        refused = [f"- the loan is refused: {v}" for v in e.violations]
    else:
        regions = deferred_regions(on_flags, options)
        loan_bytes = sum(b for r, b in on.costs.decode_only_bytes().items() if r in regions)
        for kind in ("startup", "repeat"):
            w = _workload(kind, n, on, shapes, odds, loan_bytes)
            columns.append((f"{kind} loan", rates.forecast(w)))
    which = ("the STRATA_PREFILL_* flags" if flags.elastic_loan
             else "every loan flag on (the STRATA_PREFILL_* flags leave it off)")
    k = len(rates.observations)
    seen = f"{k} earlier request{'s' * (k != 1)}" if k else "defaults (no request measured yet)"
    first = columns[0][1]
    assert not isinstance(first, str)
    return "\n".join([
        (f"forecast of a {n:,}-token prompt: the loan with {which}; rates of {device}: "
         f"{seen} ({path})"),
        format_forecasts(columns),
        f"- rates at the loan-off geometry: {rates.summary(first.coefs)}",
        f"- routing odds: {'the calibration profile' if profile else 'uniform (no profile yet)'}",
        *refused,
    ])


def _blob_lines(shapes: Shapes) -> list[str]:
    """Where a quant mix gives layers different blob sizes: each size's layers and what the
    one slot size (the largest blob) leaves unused in a full cache."""
    sizes = shapes.blob_sizes()
    if len(sizes) < 2:
        return []
    each = "; ".join(f"{n:,} B in layers {layer_ranges(ls)}" for n, ls in sizes.items())
    unused = f"{shapes.slot_slack_share():.1%} of a full cache unused"
    return [f"blobs   {each}; every slot holds the largest ({unused})"]


def _workload(kind: str | None, n: int, planned: DevicePlan, shapes: Shapes, odds: np.ndarray,
              loan_bytes: int = 0) -> Workload:
    """The workload of a first request (startup) or a later one (repeat, or no loan) on a
    freshly started engine of `planned`: the loan re-plans with every free segment."""
    plan, costs, opts = planned.plan, planned.costs, planned.plan_options
    g = plan.prompt if kind is None else plan_loan(plan, plan.free_bytes, costs, opts)
    g = shrink_geometry(g, n, costs.act_bytes_per_token, costs.act_bytes_fixed,
                        costs.expert_blob_bytes)
    lendable = opts.lendable_slots(plan.n_cache_slots, costs)
    return workload(kind, n, 0, g, shapes, plan.n_cache_slots, lendable, odds,
                    loan_bytes if kind == "repeat" else 0, loan_bytes if kind else 0)


def _model_path(model: str) -> Path:
    if model in PRESETS and not Path(model).exists():
        return preset_path(model)
    return resolve_model(model)


def run(args: argparse.Namespace) -> int:
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise StrataError(f"--prompt-tokens {args.prompt_tokens} must be at least 1")
    options, flags = engine_options(args), loan_flags()
    shapes, name, profile = _shapes(options.model)
    planned = plan_device(options, flags, shapes)
    print(plan_text(options, flags, shapes, name, planned))
    if args.prompt_tokens is not None:
        print()
        print(forecast_text(args.prompt_tokens, options, flags, shapes, profile, planned))
    return 0
