"""Guards: every refused combination of options and loan flags, reported at once (seed 000).

`validate` is pure: it runs before anything is deferred, at startup, in `strata plan` and for
every runtime flag change. Facts of the device (its traits, its capacity and the segment the
ledger will use, explicit or default) are arguments, so every device's checks run on a CPU.
"""

from __future__ import annotations

from engine.backend.base import DeviceTraits
from engine.config import ENV_NAMES, EngineOptions, LoanFlags
from engine.devices import default_segment_bytes
from engine.kernels.flash import env_problem
from engine.memory.sizes import MiB, format_mib

MIN_LOAN_SEGMENT_MIB = 64


def validate(
    options: EngineOptions,
    flags: LoanFlags,
    device: DeviceTraits,
    has_mtp: bool,
    has_native_head: bool,
    segment_bytes: int | None = None,
    capacity_bytes: int | None = None,
) -> list[str]:
    """Return every violation in words; an empty list means the combination is accepted.

    `device`: the traits of the device (`backend.traits`, or `engine.devices.device_traits`
    of its name); `segment_bytes` is the segment the ledger will use (`engine.devices.segment_bytes`: the
    explicit `--vram-segment-mib` or the device's default) and `capacity_bytes` the device's
    budget; without them only an explicit `--vram-segment-mib` is checked.
    """
    v: list[str] = []
    master = ENV_NAMES["elastic_loan"]
    if not flags.elastic_loan:
        v += [f"{ENV_NAMES[n]}=1 needs the master switch {master}=1"
              for n in flags.sub_options_on()]
    else:
        if not options.serve:
            v.append(f"{master}=1 needs --serve (the serialized serve loop)")
        if not options.vram_elastic:
            v.append(f"{master}=1 needs --vram-elastic (segmented expert cache)")
        if (problem := _loan_segment_problem(options, device, segment_bytes)) is not None:
            v.append(problem)
        if options.batch_slots > 1:
            v.append(f"{master}=1 refuses --batch-slots {options.batch_slots} (loans are one request at a time)")
        if options.prefill_head_alias:
            v.append(f"{master}=1 is incompatible with --prefill-head-alias; use one or the other")
        if not device.loans:  # HIP: the one kind of device that refuses them
            v.append(f"{master}=1 is not supported on HIP devices")
    for name in ("mtp_loan", "head_loan"):
        if getattr(flags, name) and (not options.mtp or options.spec < 2):
            v.append(f"{ENV_NAMES[name]}=1 needs --mtp with --spec >= 2")
    if flags.head_loan and not has_native_head:
        v.append(f"{ENV_NAMES['head_loan']}=1 needs a native output head (this model ties it to token_embd)")
    if options.mtp and not has_mtp:
        v.append("--mtp: this model has no MTP (nextn) layer; drop --mtp")
    if options.spec and not options.mtp:
        v.append(f"--spec {options.spec} needs --mtp (the draft comes from the MTP layer)")
    if (problem := _segment_fit_problem(options, device, segment_bytes, capacity_bytes)):
        v.append(problem)
    if device.gpu and (problem := env_problem()) is not None:
        v.append(problem)
    return v


def _loan_segment_problem(options: EngineOptions, device: DeviceTraits,
                          segment_bytes: int | None) -> str | None:
    """Loans map CUDA virtual-memory segments of at least 64 MiB, explicit or default (the
    simulated device has no such floor)."""
    if device.simulated:
        return None
    master = ENV_NAMES["elastic_loan"]
    if options.vram_segment_mib is not None:
        if options.vram_segment_mib >= MIN_LOAN_SEGMENT_MIB:
            return None
        return (f"{master}=1 needs --vram-segment-mib >= {MIN_LOAN_SEGMENT_MIB} on CUDA "
                f"(got {options.vram_segment_mib})")
    if segment_bytes is None or segment_bytes >= MIN_LOAN_SEGMENT_MIB * MiB:
        return None
    return (f"{master}=1 needs segments >= {MIN_LOAN_SEGMENT_MIB} MiB on CUDA; the default "
            f"segment of this device is {format_mib(segment_bytes)} MiB: pass "
            f"--vram-segment-mib {MIN_LOAN_SEGMENT_MIB}")


def _segment_fit_problem(options: EngineOptions, device: DeviceTraits, segment_bytes: int | None,
                         capacity_bytes: int | None) -> str | None:
    """A segment larger than the whole device leaves the ledger nothing to plan with."""
    if segment_bytes is None or capacity_bytes is None or segment_bytes <= capacity_bytes:
        return None
    if device.simulated:
        larger = "a larger simulated device (--device sim:SIZE)"
    elif options.vram_limit:
        larger = "a larger --vram-limit"
    else:
        larger = "a GPU with more free memory"
    return (f"--vram-segment-mib {segment_bytes // MiB} is larger than the whole device "
            f"({format_mib(capacity_bytes)} MiB), so not one segment fits in it; leave the "
            f"option out (the default segment here is "
            f"{format_mib(default_segment_bytes(capacity_bytes))} MiB), give a smaller one, or "
            f"use {larger}")
