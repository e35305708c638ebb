"""Device choice and default sizes: which device `auto` means (and which GPU, for a peak
sampler), the simulated device's size (capped by `--vram-limit`) and segment, and a device's
traits read from its name (`device_traits`) where no backend is open yet."""

from __future__ import annotations

import os
import platform
import re
from dataclasses import replace

from engine.backend.base import CUDA_TRAITS, SIM_TRAITS, DeviceTraits
from engine.backend.process_memory import PeakSampler
from engine.config import EngineOptions
from engine.errors import FlagError
from engine.memory.plan_types import ModelCosts
from engine.memory.sizes import MiB, format_size, parse_size


def default_segment_bytes(capacity_bytes: int) -> int:
    """Sim segments: a power of two near 1/64 of the device, between 64 KiB and 512 MiB, so
    the segment map has a readable number of cells whatever the simulated size."""
    seg = 64 << 10
    while seg * 64 < capacity_bytes and seg < 512 * MiB:
        seg *= 2
    return seg


def segment_bytes(options: EngineOptions, capacity_bytes: int) -> int:
    """The ledger's segment: `--vram-segment-mib`, else the default for this capacity."""
    if options.vram_segment_mib:
        return options.vram_segment_mib * MiB
    return default_segment_bytes(capacity_bytes)


def vram_limit_bytes(options: EngineOptions) -> int | None:
    """`--vram-limit` in bytes (None without one); FlagError on a value that is not a size."""
    if options.vram_limit is None:
        return None
    return parse_size(options.vram_limit, what="--vram-limit")  # '' too is not a size


def sim_device(device: str, costs: ModelCosts, reserve_bytes: int, limit_bytes: int | None) -> str:
    """The device as `make_backend` takes it. The simulated device gets its size: the one
    given (`sim:SIZE`) or `default_sim_bytes`, capped by `--vram-limit` as a GPU's budget is
    (`sim:N` in bytes). Other devices, and a size that does not parse (`make_backend` names
    it), are returned as they are."""
    kind, colon, size = device.partition(":")
    if kind.strip().lower() != "sim":
        return device
    if colon and not size.strip():
        raise FlagError(f"--device {device} has no size; write sim:SIZE (e.g. sim:8GiB) or sim")
    if not size:
        n_bytes = default_sim_bytes(costs, reserve_bytes)
        check_host_room(device, n_bytes, "this model with these options (--ctx, "
                        "--vram-reserve-mib) needs a simulated device of")
    else:
        try:
            n_bytes = parse_size(size)
        except FlagError:
            return device
        check_host_room(device, n_bytes)
        if limit_bytes is None:
            return device
    return f"sim:{min(n_bytes, limit_bytes or n_bytes)}"


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_host_room(device: str, n_bytes: int, needs: str = "") -> None:
    """The simulated device lives in host memory: a size past the machine's physical memory
    (`sim:1TiB`, or the default size of a `--ctx` of 10**19) is a FlagError naming what fits,
    not a failed map or a swapping host. `needs` says where the size came from."""
    host = host_memory_bytes()
    if host is None or n_bytes <= host:
        return
    if needs:
        raise FlagError(f"--device {device}: {needs} {format_size(n_bytes)}, more than this "
                        f"machine's {format_size(host)} of memory; lower them")
    raise FlagError(
        f"--device {device}: the simulated device lives in host memory and this machine "
        f"has {format_size(host)}; give at most sim:{host // MiB}MiB"
    )


def default_sim_bytes(costs: ModelCosts, reserve_bytes: int) -> int:
    """The simulated device size when none is given: every mandatory and decode-only item
    plus room for THREE QUARTERS of the experts, rounded up to a MiB. The expert cache then
    cannot hold every expert (prefill streams the rest, as on a consumer card), the prompt
    path borrows its tail, and the memory a loan frees visibly changes the prompt geometry.
    (With half, a small model's borrowable tail is too short for one 256-token chunk.) A model
    whose experts are small next to a chunk's activations also gets room for an owned
    256-token prompt path."""
    fixed = costs.dense_bytes + costs.kv_bytes + reserve_bytes
    fixed += sum(costs.decode_only_bytes().values())
    n_cache = costs.n_blobs * 3 // 4
    total = fixed + costs.cache_bytes(n_cache)
    min_prompt = costs.chunk_bytes(256) + 2 * costs.n_expert_used * costs.expert_blob_bytes
    if 0.9 * n_cache * costs.expert_blob_bytes < min_prompt:
        total += 2 * min_prompt  # twice: segment rounding of the two prompt regions
    return -(-total // MiB) * MiB


def cuda_available() -> bool:
    """A CUDA device CuPy can use (never imports CuPy's heavy parts on a CPU machine)."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device: all mean "no CUDA here"
        return False


def resolve_device(spec: str) -> str:
    """`auto` is CUDA when present, else the simulated device."""
    if spec != "auto":
        return spec
    return "cuda" if cuda_available() else "sim"


def cuda_index(device: str) -> int | None:
    """The GPU index `device` names once resolved ("cuda" -> 0, "cuda:1" -> 1, "auto" on a
    GPU machine -> 0); None for the simulated device (and a spec that names no GPU)."""
    kind, _, arg = resolve_device(device).strip().partition(":")
    if kind.lower() != "cuda" or not (arg or "0").isdigit():
        return None
    return int(arg or 0)


def peak_sampler(device: str) -> PeakSampler | None:
    """A sampler (not started) of this process's NVML bytes on the GPU `device` names; None
    on the simulated device or without NVML."""
    index = cuda_index(device)
    return None if index is None else PeakSampler.open(index)


# A device no backend opens (`make_backend` names it): what the code did for any name that
# was neither CUDA nor the simulated one; the loan refuses HIP by name.
OTHER_TRAITS = replace(SIM_TRAITS, simulated=False)
KIND_TRAITS = {"sim": SIM_TRAITS, "cuda": CUDA_TRAITS, "hip": replace(OTHER_TRAITS, loans=False)}


def device_traits(device: str) -> DeviceTraits:
    """The traits of the device `device` names where no backend is open yet (startup
    planning, the guards, the forecast's defaults): a device as given or resolved
    (`sim:8GiB`, `cuda:1`; not `auto`) or the name its rates are kept under
    (`cuda NVIDIA H200`). The one place a device's kind is read from a string; an open
    backend says the same in `backend.traits`."""
    kind = re.split(r"[:\s]", device.strip(), maxsplit=1)[0].lower()
    return KIND_TRAITS.get(kind, OTHER_TRAITS)


def dense_quantized(traits: DeviceTraits, options: EngineOptions) -> bool:
    """Whether dense linear weights stay in their quantized blocks (`--dense`; 'auto': the
    device's `dense_blocks`)."""
    if options.dense == "auto":
        return traits.dense_blocks
    return options.dense == "quant"


def cache_policy(traits: DeviceTraits, options: EngineOptions) -> str:
    """`--cache-policy` on a device ('auto': the device's `cache_policy`)."""
    if options.cache_policy == "auto":
        return traits.cache_policy
    return options.cache_policy


def hardware_name(device_index: int | None) -> str:
    """What a device's measured prefill rates are kept under: 'cuda NVIDIA H200' for a CUDA
    device (`device_index`), else 'sim ' and the host's CPU model and core count (the
    simulated device computes on the CPU)."""
    if device_index is not None:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(device_index)["name"]
        return f"cuda {name.decode() if isinstance(name, bytes) else name}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"sim {cpu} x{os.cpu_count() or 1}"
