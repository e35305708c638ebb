"""Guards: every refused combination of options and loan flags, reported at once (seed 000).

`validate` is pure: it runs before anything is deferred, at startup and for every runtime
flag change.
"""

from __future__ import annotations

from engine.config import ENV_NAMES, EngineOptions, LoanFlags

MIN_LOAN_SEGMENT_MIB = 64


def validate(
    options: EngineOptions,
    flags: LoanFlags,
    device: str,
    has_mtp: bool,
    has_native_head: bool,
    segment_mib: int | None = None,
) -> list[str]:
    """Return every violation in words; an empty list means the combination is accepted."""
    v: list[str] = []
    master = ENV_NAMES["elastic_loan"]
    subs = [n for n in ("mtp_loan", "head_loan", "retain_startup_chunk", "repeat_loan")
            if getattr(flags, n)]
    if not flags.elastic_loan:
        v += [f"{ENV_NAMES[n]}=1 needs the master switch {master}=1" for n in subs]
    else:
        if not options.serve:
            v.append(f"{master}=1 needs --serve (the serialized serve loop)")
        if not options.vram_elastic:
            v.append(f"{master}=1 needs --vram-elastic (segmented expert cache)")
        seg = segment_mib if segment_mib is not None else options.vram_segment_mib
        if seg is not None and seg < MIN_LOAN_SEGMENT_MIB and not device.startswith("sim"):
            v.append(
                f"{master}=1 needs --vram-segment-mib >= {MIN_LOAN_SEGMENT_MIB} on CUDA (got {seg})"
            )
        if options.batch_slots > 1:
            v.append(f"{master}=1 refuses --batch-slots {options.batch_slots} (loans are one request at a time)")
        if options.prefill_head_alias:
            v.append(f"{master}=1 is incompatible with --prefill-head-alias; use one or the other")
        if device.startswith("hip"):
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
    if device.startswith("cuda"):
        from engine.kernels.flash import env_problem

        if (problem := env_problem()) is not None:
            v.append(problem)
    return v
