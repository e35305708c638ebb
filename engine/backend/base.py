"""The device a model runs on, as one explicit object: array module, memory, counted copies
and the model's ops.

Model code takes `xp` from a `Backend` and never imports numpy or cupy itself; it calls the
backend's ops (`linear`, `rms_norm`, `rope`, `attention`, `route`, `moe`, the KV codec,
`embed`) and never asks which device it runs on: the backend is the dispatch point. Every
host<->device copy of model data goes through `upload`/`to_device`/`download`, so `stats`
counts the PCIe traffic.

Device memory comes in two forms:

- `alloc(n_bytes)`: one standalone buffer, freed by `free`. Memory that no ledger region owns
  shows up as `unaccounted` in the ledger snapshot, so model code does not call it.
- `reserve_address_space(n_bytes)`: a range of device addresses with nothing behind it; the
  ledger maps and unmaps physical segments inside it (`map`/`unmap`). This is what CUDA's virtual
  memory API gives (`cuMemAddressReserve` + `cuMemCreate`/`cuMemMap`): a region's bytes are
  contiguous however its segments were obtained, unmapping really frees memory, and a range that
  is mapped again has the same addresses, so views and captured graphs taken earlier stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
from gguf import GGMLQuantizationType

from engine.gguf.quant import ExpertLayout
from engine.memory.budget import ProcessBudget

# A device array: numpy.ndarray on the sim backend, cupy.ndarray on CUDA.
DeviceArray = Any


@dataclass(frozen=True)
class Routing:
    """How router logits [T, E] become each row's top-k experts and their weights: qwen3moe's
    softmax (the default), or glm4moe's sigmoid with the top-k chosen on the probabilities plus
    a per-expert bias while the weights are the probabilities themselves; then renormalised to
    sum 1 (`norm`) and multiplied by `scale`."""

    k: int
    sigmoid: bool = False
    norm: bool = True
    scale: float = 1.0


@dataclass(frozen=True)
class KVCells:
    """Every cell of one layer's KV cache as views, what `attention_at` reads and writes in
    place (the CUDA kernels take it as it is).

    `kind` "q4_0": `k`, `v` uint8 [n_ctx, Hkv, D/2] and `k_scale`, `v_scale` float16
    [n_ctx, Hkv, D/32]; "int8": int8 [n_ctx, Hkv, D] and float32 [n_ctx, Hkv, 1] scales;
    "f16": `k`, `v` float16 [n_ctx, Hkv, D] and no scales (None)."""

    kind: str
    k: DeviceArray
    k_scale: DeviceArray | None
    v: DeviceArray
    v_scale: DeviceArray | None

    @property
    def n_ctx(self) -> int:
        return int(self.k.shape[0])

    @property
    def n_head_kv(self) -> int:
        return int(self.k.shape[1])


@dataclass(frozen=True)
class DevicePosition:
    """A decode step's first position held in device memory (`array`: int32 [1]), what a
    captured step reads: one capture serves every position (the token graph writes the value
    before each replay). The ops that take a `Position` read it there."""

    array: DeviceArray


# Where a forward's rows start: a host int (a prompt chunk, an eager step) or a device one.
Position = int | DevicePosition


@dataclass(frozen=True)
class MemInfo:
    """The process's device budget (the simulated capacity; on CUDA the whole-process
    `--vram-limit`), what is left of it, and the process's bytes (None where NVML cannot tell)."""

    total_bytes: int
    free_bytes: int
    process_bytes: int | None


@dataclass(frozen=True)
class CopyCounts:
    """A frozen reading of `CopyStats`; subtract two readings for the copies in between."""

    h2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_bytes: int = 0
    d2h_copies: int = 0

    def __sub__(self, other: CopyCounts) -> CopyCounts:
        return CopyCounts(
            *(getattr(self, f.name) - getattr(other, f.name) for f in fields(CopyCounts))
        )


@dataclass
class CopyStats:
    """Running host<->device copy counters of one backend."""

    h2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_bytes: int = 0
    d2h_copies: int = 0

    def count_h2d(self, n_bytes: int) -> None:
        self.h2d_bytes += n_bytes
        self.h2d_copies += 1

    def count_d2h(self, n_bytes: int) -> None:
        self.d2h_bytes += n_bytes
        self.d2h_copies += 1

    def reset(self) -> None:
        """Zero every counter."""
        self.h2d_bytes = self.h2d_copies = self.d2h_bytes = self.d2h_copies = 0

    def snapshot(self) -> CopyCounts:
        """The counters now, frozen."""
        return CopyCounts(self.h2d_bytes, self.h2d_copies, self.d2h_bytes, self.d2h_copies)


@runtime_checkable
class AddressSpace(Protocol):
    """A reserved range of device addresses; physical memory is mapped into it piecewise.

    Offsets and sizes given to `map`/`unmap` are multiples of `granularity_bytes`; `unmap` takes
    exactly a range that one `map` call mapped (one physical allocation, as on CUDA).
    """

    n_bytes: int
    granularity_bytes: int

    @property
    def mapped_bytes(self) -> int:
        """Bytes of physical memory mapped into this range now."""
        ...

    def map(self, offset: int, n_bytes: int) -> None:
        """Back [offset, offset + n_bytes) with new physical memory; contents are undefined."""
        ...

    def unmap(self, offset: int, n_bytes: int) -> None:
        """Give the physical memory behind a mapped range back to the device."""
        ...

    def view(self, offset: int, n_bytes: int) -> DeviceArray:
        """A uint8 device view [n_bytes] of a mapped range."""
        ...

    def close(self) -> None:
        """Unmap everything and give the address range back."""
        ...


@dataclass(frozen=True)
class DeviceTraits:
    """What the code that is not the backend's own needs to know of a device, asked once: of
    the backend (`backend.traits`) or, before one exists (startup planning, the guards, the
    forecast's defaults), of the device's name (`engine.devices.device_traits`, the only
    place a device string is read for its kind)."""

    gpu: bool  # a CUDA GPU: its kernels (and what they need), its whole-process budget, NVML
    graphs: bool  # decode steps can be captured and replayed (the token graph)
    simulated: bool  # device memory is host memory of a chosen size (no loan segment floor)
    loans: bool  # the elastic loan runs here
    weight_bytes: int  # bytes of a dense weight element on the device (float16 or float32)
    dense_blocks: bool  # `--dense auto`: dense linear weights stay in their quantized blocks
    ring_layers: int  # layers of experts the prompt path's staging ring holds
    cache_policy: str  # `--cache-policy auto`: 'adaptive' or 'static'
    rates: str  # the forecast's defaults before the first request: 'cuda' or 'sim'
    flops_unit: str  # how the forecast's fitted compute rates are written


# The simulated device computes with NumPy on the CPU: float32 weights, dense weights decoded
# once at load (array code would decode blocks at every use), one layer of experts in the ring
# (copies are memcpy, nothing to overlap), the profile's fill kept (array code decodes hits and
# misses alike: a promotion only adds a copy and a decode; the demo decoded 20% slower with it).
SIM_TRAITS = DeviceTraits(gpu=False, graphs=False, simulated=True, loans=True, weight_bytes=4,
                          dense_blocks=False, ring_layers=1, cache_policy="static", rates="sim",
                          flops_unit="GFLOP/s")
# A CUDA GPU: float16 weights (tensor cores), dense weights kept in their blocks (the kernels
# read blocks as fast as floats), two layers of experts in the ring (the next layer's uploads
# run while this one computes), decoding misses admitted (a miss crosses the host link, a hit
# does not).
CUDA_TRAITS = DeviceTraits(gpu=True, graphs=True, simulated=False, loans=True, weight_bytes=2,
                           dense_blocks=True, ring_layers=2, cache_policy="adaptive", rates="cuda",
                           flops_unit="TFLOP/s")


@runtime_checkable
class ExpertProvider(Protocol):
    """Where the backend's `moe` op gets a layer's routed experts: as decoded float32 weights
    (the array ops) or as their quantized bytes on the device (the CUDA kernels).

    Where the bytes go through a staging ring (`ring_slots` not None), `blobs` is asked for
    groups of at most `ring_slots` experts that `needs_slot`, and `reads_queued` is told when
    the kernels that read a group are queued, so the next group's uploads can overlap them.
    """

    def layout_of(self, layer: int) -> ExpertLayout:
        """The byte layout of `layer`'s expert blobs (layers may differ in quant types)."""
        ...

    @property
    def ring_slots(self) -> int | None:
        """Slots of the staging ring the misses go through, or None (no ring)."""
        ...

    def prepare(self, layer: int, experts: list[int]) -> None:
        """Once per (chunk, layer): the sorted experts its rows route to."""
        ...

    def prefetch(self, layer: int) -> None:
        """Queue the uploads layer `layer` will read, ahead of its compute (where nothing is
        staged ahead: nothing)."""
        ...

    def weights(self, layer: int, expert: int) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
        """(gate [f, d], up [f, d], down [d, f]) float32 device arrays."""
        ...

    def blobs(self, layer: int, experts: list[int]) -> list[DeviceArray]:
        """uint8 device bytes of each expert (gate | up | down, `layout_of(layer)`; a slot
        may be longer than the blob)."""
        ...

    def needs_slot(self, layer: int, expert: int) -> bool:
        """Whether `blobs` stages (layer, expert) in a ring slot (it is not resident)."""
        ...

    def reads_queued(self, layer: int, experts: list[int]) -> None:
        """The compute reading these experts' bytes is queued (their ring slots may be reused
        after it)."""
        ...

    def source(self, layer: int) -> Any | None:
        """Where the MoE kernels find `layer`'s experts themselves (`Backend.moe_at`: the
        routed ids stay on the device, a captured step), or None: the host reads the routing
        and the provider hands the experts over (`prepare`, `weights`, `blobs`)."""
        ...


@runtime_checkable
class PromptArena(Protocol):
    """Where a prompt chunk's temporaries live while it runs (`with arena:`), with what they
    took: the buffer, the most in use at once, what did not fit (`spilled_bytes`)."""

    n_bytes: int
    peak_bytes: int
    spilled_bytes: int

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def close(self) -> None:
        """Give the buffer back; raises if a temporary still lives in it."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A device: its array module, its memory, its (counted) copies and the model's ops.

    Model code calls the ops and never asks which device it runs on; each backend implements
    every op (`SimBackend`: array code on NumPy; `CudaBackend`: CuPy kernels where one applies).
    Every host<->device copy of model data (weights, experts, activations, logits, routing
    reads) goes through `upload`, `to_device` or `download` and is counted in `stats`; the
    kernels' own launch tables and constant tables (pointers, row plans, RoPE frequencies,
    quant grids: a few KiB) are not.
    """

    name: str  # "sim" or "cuda:0"
    traits: DeviceTraits  # what differs between devices, for code that is not the backend's
    device_index: int | None  # the CUDA device's index; None on the simulated device
    xp: ModuleType  # numpy on sim, cupy on CUDA
    capacity_bytes: int
    stats: CopyStats
    async_copies: bool  # uploads run on a copy stream beside compute (staging ahead pays)

    # -- memory ---------------------------------------------------------------------------------

    def alloc(self, n_bytes: int) -> DeviceArray:
        """A standalone uint8 device buffer [n_bytes]; ledger regions do not use this."""
        ...

    def free(self, buf: DeviceArray) -> None:
        """Free a buffer that `alloc` returned."""
        ...

    def reserve_address_space(self, n_bytes: int) -> AddressSpace:
        """Reserve device addresses for a ledger region; no memory is taken until `map`."""
        ...

    def mem_info(self) -> MemInfo:
        """Total, free and (where known) this process's device bytes."""
        ...

    def chunk_arena(self, buf: DeviceArray) -> PromptArena | None:
        """An arena routing the device's temporaries into `buf` (uint8 bytes of a prompt
        chunk), or None where temporaries are not device memory (the sim's are host memory)."""
        ...

    # -- copies and ordering --------------------------------------------------------------------

    def upload(self, host: np.ndarray | list[np.ndarray], out: DeviceArray) -> None:
        """Copy host bytes (an array, or a list of arrays back to back) into an existing
        device buffer or view of the same total byte size; counted as one copy."""
        ...

    def upload_many(self, jobs: list[tuple[np.ndarray | list[np.ndarray], DeviceArray]], *,
                    after: list[Any] | None = None) -> Any:
        """`upload` of several (host, out) copies, counted one each; returns a point to `wait`
        for. `after`: `mark`s past the last reader of every `out` (None: all compute queued)."""
        ...

    def to_device(self, host: np.ndarray) -> DeviceArray:
        """A new device array holding a copy of `host`; counted as one copy."""
        ...

    def download(self, dev: DeviceArray) -> np.ndarray:
        """A host copy of a device array; counted."""
        ...

    def as_device(self, a: Any) -> DeviceArray:
        """`a` as a device array: itself where it is one, else a counted copy (`to_device`)."""
        ...

    def mark(self) -> Any:
        """A point in the compute queue, for `upload_many`'s `after`."""
        ...

    def wait(self, event: Any) -> None:
        """Make compute queued from now on wait for `event` (from `upload_many`)."""
        ...

    def keep_for_upload(self, host: np.ndarray) -> None:
        """`host` will be uploaded again and again (a loan's restore source: the decoded
        head): make those copies as fast as the device allows (page-locked on CUDA, so a
        restore is one DMA instead of a staged copy); nothing where copies are memcpy."""
        ...

    def synchronize(self) -> None:
        """Wait for all queued device work and copies."""
        ...

    def time_mark(self) -> Any:
        """A point in stream order to time from (a CUDA event; the wall clock on the sim)."""
        ...

    def seconds_between(self, start: Any, end: Any) -> float:
        """Seconds between two `time_mark`s (waits for `end`)."""
        ...

    # -- the model's ops ------------------------------------------------------------------------

    def linear(self, x: DeviceArray, w: DeviceArray) -> DeviceArray:
        """x [.., n_in] @ w [n_out, n_in]^T -> float32 [.., n_out]."""
        ...

    def rms_norm(self, x: DeviceArray, weight: DeviceArray, eps: float) -> DeviceArray:
        """RMSNorm over the last axis of x [.., n] with weight [n]; float32 out."""
        ...

    def rope(self, x: DeviceArray, pos: Position, base: float, n_rot: int = 0) -> DeviceArray:
        """x [T, H, D] rotated (NEOX) at positions pos..; may rotate x in place. `n_rot`: only
        the first n_rot dims of a head (partial RoPE, frequencies over n_rot), 0: all D."""
        ...

    def attention(self, q: DeviceArray, k: DeviceArray, v: DeviceArray, pos0: int) -> DeviceArray:
        """Causal GQA: q [T, H, D] at positions pos0.., k, v [S, Hkv, D] -> float32 [T, H, D]."""
        ...

    def attention_at(self, q: DeviceArray, k: DeviceArray, v: DeviceArray, cells: KVCells,
                     pos: DevicePosition) -> DeviceArray:
        """A decode step's attention with its position on the device: k, v [T, Hkv, D] float32
        written into one layer's KV `cells` at pos.., then q [T, H, D] attended over cells
        0..pos+T -> float32 [T, H, D]."""
        ...

    def route(self, logits: DeviceArray, routing: Routing, bias: DeviceArray | None = None
              ) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
        """Router logits [T, E] -> (ids [T, k], weights [T, k], margin [T]) as `routing` says;
        `bias` [E] (sigmoid routing): added to the probabilities for the choice only. `margin`:
        the k-th minus the (k+1)-th choice score, how far the top-k is from a tie."""
        ...

    def expert_counts(self, ids: DeviceArray, n_expert: int) -> np.ndarray:
        """Routed ids [T, k] on the device -> host int [E]: rows per expert."""
        ...

    def moe(self, h: DeviceArray, ids: Any, w: DeviceArray, used: list[int], counts: np.ndarray,
            experts: ExpertProvider, layer: int) -> DeviceArray:
        """The routed FFN of one layer: h [T, d] normed, ids [T, k] (on the host for a decode
        step), w [T, k], `used` the sorted experts named, `counts` host rows per expert [E]
        -> float32 [T, d]."""
        ...

    def moe_at(self, h: DeviceArray, ids: DeviceArray, w: DeviceArray, source: Any) -> DeviceArray:
        """A captured decode step's routed FFN: h [T, d] normed, ids / w [T, k] left on the
        device; the kernels find each expert from `source` (an `ExpertProvider.source`: the
        staged residency row, cache slots and the page-locked file) -> float32 [T, d]."""
        ...

    def decode_expert(self, blob: DeviceArray, layout: ExpertLayout
                      ) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
        """An expert's quantized device bytes uint8 [blob_bytes] -> float32 (gate [f, d],
        up [f, d], down [d, f]) on the device (what the array ops' `moe` computes with)."""
        ...

    def kv_store(self, kind: str, x: DeviceArray, cells: DeviceArray, scales: Any) -> None:
        """Encode x [T, Hkv, D] float32 into KV cells of kind `kind` and their scales."""
        ...

    def kv_load(self, kind: str, cells: DeviceArray, scales: Any, chunk: bool = False) -> DeviceArray:
        """KV cells [n, Hkv, ..] of kind `kind` and their scales -> float32 [n, Hkv, D]; for
        a prompt chunk's attention (`chunk`) in the dtype its kernel reads (fp16 on CUDA)."""
        ...

    def embed(self, rows: np.ndarray, qtype: GGMLQuantizationType, n_embd: int) -> DeviceArray:
        """Quantized embedding rows in host memory, uint8 [T, row_bytes] -> float32 [T, d]."""
        ...

    def close(self) -> None:
        """Give back what the backend holds itself (standalone buffers, cached blocks,
        page-locked host memory); ledger regions are closed by their ledger first. Idempotent."""
        ...


class GpuBackend(Backend, Protocol):
    """A GPU's own surface beyond the `Backend` protocol (`traits.gpu`): its whole-process
    budget, the bytes it holds outside the ledger, page-locked host memory."""

    budget: ProcessBudget

    def refresh_outside(self) -> int:
        """Measure again what the process holds outside the ledger; those bytes."""
        ...

    def memory_line(self) -> str:
        """A trace line: the process's bytes now and their parts."""
        ...

    def pin(self, host: np.ndarray) -> None:
        """Page-lock `host` for the device's copies (DeviceError where it cannot)."""
        ...


def as_gpu(backend: Backend) -> GpuBackend | None:
    """`backend` as a GPU where its traits say it is one; None on other devices."""
    return cast(GpuBackend, backend) if backend.traits.gpu else None
