"""The ledger: the device budget cut into segments, every byte in use owned by a named region.

A region is a whole number of segments mapped into its own reserved address range, so its bytes
are contiguous wherever the segments came from, `grow`/`shrink` keep the addresses of the bytes
that stay, and a region released and reserved again gets the same addresses back (CUDA graphs
captured on it survive a loan). Segment indices are budget units: `segment_map[i]` names the region
that owns unit i. Questions (`can_reserve`, `free_bytes`, `snapshot`) never change state; actions
(`reserve`, `grow`, `shrink`, `release`) do, and each one publishes a snapshot to `on_change`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from engine.backend.base import AddressSpace, Backend, DeviceArray
from engine.errors import LedgerError
from engine.memory.sizes import MiB, align_up, ceil_div, format_mib

DEFAULT_SEGMENT_BYTES = 512 * MiB  # Strata's elastic-cache segment; the sim may use 8 MiB
REGION_NAMES = (
    "weights.dense",
    "kv",
    "experts.cache",
    "head.native",
    "mtp.experts",
    "mtp.draft_head",
    "verifier",
    "prompt.chunk",
    "prompt.ring",
    "reserve",
)
# Decode-only regions, in the order a loan releases them (it restores them in reverse).
DECODE_ONLY_REGIONS = ("verifier", "head.native", "mtp.experts", "mtp.draft_head")


@dataclass(frozen=True)
class RegionInfo:
    """One region in a snapshot: bytes asked for and whole segments mapped."""

    name: str
    used_bytes: int
    n_segments: int
    mapped_bytes: int


@dataclass(frozen=True)
class LedgerSnapshot:
    """The ledger at one moment; what the UI's VRAM bar and segment map draw.

    `unaccounted_bytes` is device memory the process holds outside every region (on CUDA NVML's
    process bytes minus the mapped regions: the context, cuBLAS, kernels, CuPy's pool); None
    where the backend cannot tell. `limit_bytes` is what the whole process may hold (the
    simulated capacity; on CUDA `--vram-limit`): the VRAM bar's total.
    """

    seq: int  # counts actions; a new number means something changed
    capacity_bytes: int
    segment_bytes: int
    regions: tuple[RegionInfo, ...]  # in REGION_NAMES order
    free_bytes: int
    segment_map: tuple[str, ...]  # [n_segments] owning region name, "" when free
    unaccounted_bytes: int | None
    limit_bytes: int

    def region(self, name: str) -> RegionInfo | None:
        """The named region, or None when it is not reserved."""
        return next((r for r in self.regions if r.name == name), None)


class Region:
    """A named run of whole segments, contiguous in device addresses; hands out uint8 views."""

    def __init__(self, name: str, aspace: AddressSpace, segment_bytes: int):
        self.name = name
        self.segments: list[int] = []  # budget-unit indices; the k-th maps at k * segment_bytes
        self.used_bytes = 0
        self.live = True
        self._aspace = aspace
        self._segment_bytes = segment_bytes
        self._carved_bytes = 0

    @property
    def n_segments(self) -> int:
        return len(self.segments)

    @property
    def mapped_bytes(self) -> int:
        return len(self.segments) * self._segment_bytes

    def view(self, offset: int, n_bytes: int) -> DeviceArray:
        """A uint8 device view [n_bytes] at `offset`; the range must lie in the used bytes."""
        assert self.live, f"view of released region {self.name}"
        assert 0 <= offset and offset + n_bytes <= self.used_bytes, (
            f"{self.name}: view {offset}+{n_bytes} outside {self.used_bytes} used bytes"
        )
        return self._aspace.view(offset, n_bytes)

    def carve(self, n_bytes: int, *, align: int = 256) -> DeviceArray:
        """The next `n_bytes` of the region (bump allocation, `align`-aligned start)."""
        start = align_up(self._carved_bytes, align)
        view = self.view(start, n_bytes)
        self._carved_bytes = start + n_bytes
        return view

    @property
    def carved_bytes(self) -> int:
        """Bytes carved so far (the last view's end)."""
        return self._carved_bytes

    def reset_carve(self) -> None:
        """Start carving from offset 0 again (the views carved before are reused memory)."""
        self._carved_bytes = 0


class Ledger:
    """Regions x segments over one backend (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        capacity_bytes: int | None = None,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        on_change: Callable[[LedgerSnapshot], None] | None = None,
    ):
        budget = backend.mem_info().free_bytes if capacity_bytes is None else capacity_bytes
        n_segments = budget // segment_bytes
        if n_segments < 1:
            raise LedgerError(
                f"device budget {format_mib(budget)} MiB is smaller than one "
                f"{format_mib(segment_bytes)} MiB segment; use a smaller segment size"
            )
        self.backend = backend
        self.segment_bytes = segment_bytes
        self.capacity_bytes = n_segments * segment_bytes  # the remainder is never used
        self.on_change = on_change
        self._owner: list[str] = [""] * n_segments  # [n_segments]
        self._regions: dict[str, Region] = {}
        self._aspaces: dict[str, AddressSpace] = {}  # kept across release: stable addresses
        self._seq = 0

    # -- questions ------------------------------------------------------------------------------

    @property
    def n_segments(self) -> int:
        return len(self._owner)

    @property
    def n_free_segments(self) -> int:
        return self._owner.count("")

    @property
    def free_bytes(self) -> int:
        return self.n_free_segments * self.segment_bytes

    def segments_for(self, n_bytes: int) -> int:
        """Whole segments that hold `n_bytes`."""
        return ceil_div(n_bytes, self.segment_bytes)

    def can_reserve(self, n_bytes: int) -> bool:
        """Whether a new region of `n_bytes` fits now."""
        return self.segments_for(n_bytes) <= self.n_free_segments

    def can_grow(self, name: str, n_bytes: int) -> bool:
        """Whether region `name` can take `n_bytes` more now."""
        r = self._regions[name]
        return self.segments_for(r.used_bytes + n_bytes) - r.n_segments <= self.n_free_segments

    def has(self, name: str) -> bool:
        return name in self._regions

    def region(self, name: str) -> Region:
        """The live region `name` (KeyError when it is not reserved)."""
        return self._regions[name]

    def region_bytes(self, name: str) -> int:
        """Mapped bytes of region `name`; 0 when it is not reserved."""
        r = self._regions.get(name)
        return r.mapped_bytes if r else 0

    def snapshot(self) -> LedgerSnapshot:
        """The ledger now, frozen."""
        regions = tuple(
            RegionInfo(n, r.used_bytes, r.n_segments, r.mapped_bytes)
            for n in REGION_NAMES
            if (r := self._regions.get(n)) is not None
        )
        info = self.backend.mem_info()
        process = info.process_bytes
        mapped = sum(r.mapped_bytes for r in regions)
        return LedgerSnapshot(
            seq=self._seq,
            capacity_bytes=self.capacity_bytes,
            segment_bytes=self.segment_bytes,
            regions=regions,
            free_bytes=self.free_bytes,
            segment_map=tuple(self._owner),
            unaccounted_bytes=None if process is None else max(0, process - mapped),
            limit_bytes=info.total_bytes,
        )

    # -- actions --------------------------------------------------------------------------------

    def reserve(self, name: str, n_bytes: int) -> Region:
        """A new region `name` of `n_bytes` (rounded up to whole segments)."""
        assert name in REGION_NAMES, f"unknown region {name!r}; one of {REGION_NAMES}"
        assert name not in self._regions, f"region {name} is already reserved; grow() it"
        assert n_bytes >= 0, n_bytes
        self._require(name, self.segments_for(n_bytes), n_bytes)
        aspace = self._aspaces.get(name)
        if aspace is None:
            aspace = self.backend.reserve_address_space(self.capacity_bytes)
            assert self.segment_bytes % aspace.granularity_bytes == 0, (
                f"segment {self.segment_bytes} B is not a multiple of the device's mapping "
                f"granularity {aspace.granularity_bytes} B"
            )
            self._aspaces[name] = aspace
        region = Region(name, aspace, self.segment_bytes)
        self._map(region, self.segments_for(n_bytes))
        region.used_bytes = n_bytes
        self._regions[name] = region
        self._changed()
        return region

    def grow(self, name: str, n_bytes: int) -> Region:
        """Add `n_bytes` to region `name`; bytes already there keep their addresses."""
        region = self._regions[name]
        assert n_bytes >= 0, n_bytes
        extra = self.segments_for(region.used_bytes + n_bytes) - region.n_segments
        self._require(name, extra, n_bytes)
        self._map(region, extra)
        region.used_bytes += n_bytes
        self._changed()
        return region

    def shrink(self, name: str, n_bytes: int) -> Region:
        """Take `n_bytes` off the end of region `name`; whole segments past the end are freed."""
        region = self._regions[name]
        assert 0 <= n_bytes <= region.used_bytes, (name, n_bytes, region.used_bytes)
        region.used_bytes -= n_bytes
        self._unmap(region, region.n_segments - self.segments_for(region.used_bytes))
        self._changed()
        return region

    def release(self, name: str) -> int:
        """Unmap region `name` and return its segments to the free pool; the bytes freed."""
        region = self._regions.pop(name)
        freed = region.mapped_bytes
        self._unmap(region, region.n_segments)
        region.used_bytes = 0
        region.live = False
        self._changed()
        return freed

    def close(self) -> None:
        """Release every region and give the address ranges back."""
        for name in list(self._regions):
            self.release(name)
        for aspace in self._aspaces.values():
            aspace.close()
        self._aspaces.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- integrity ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError listing every broken invariant, with the numbers."""
        errors: list[str] = []
        seg = self.segment_bytes
        all_segments = [s for r in self._regions.values() for s in r.segments]
        twice = [s for s, n in Counter(all_segments).items() if n > 1]
        if twice:
            errors.append(f"segments owned twice: {sorted(twice)}")
        mapped = sum(r.mapped_bytes for r in self._regions.values())
        if mapped + self.free_bytes != self.capacity_bytes:
            errors.append(
                f"bytes not conserved: regions {mapped} + free {self.free_bytes} "
                f"!= capacity {self.capacity_bytes}"
            )
        owned = Counter(o for o in self._owner if o)
        for name, r in self._regions.items():
            if owned.get(name, 0) != r.n_segments or any(
                self._owner[s] != name for s in r.segments
            ):
                errors.append(
                    f"{name}: segment map has {owned.get(name, 0)} segments, region "
                    f"{r.n_segments} ({r.segments})"
                )
            if not r.used_bytes <= r.mapped_bytes < r.used_bytes + seg:
                errors.append(f"{name}: {r.used_bytes} used bytes in {r.mapped_bytes} mapped")
            aspace_bytes = self._aspaces[name].mapped_bytes
            if aspace_bytes != r.mapped_bytes:
                errors.append(f"{name}: device maps {aspace_bytes} bytes, ledger {r.mapped_bytes}")
        stray = set(owned) - set(self._regions)
        if stray:
            errors.append(f"segment map names regions that do not exist: {sorted(stray)}")
        if errors:
            raise AssertionError("ledger: " + "; ".join(errors))

    # -- helpers --------------------------------------------------------------------------------

    def _require(self, name: str, n_segments: int, n_bytes: int) -> None:
        free = self.n_free_segments
        if n_segments > free:
            raise LedgerError(
                f"region {name} needs {n_segments} more segments for {format_mib(n_bytes)} MiB, "
                f"{free} free ({format_mib(free * self.segment_bytes)} MiB); release a region "
                f"or re-plan with `strata plan`"
            )

    def _map(self, region: Region, n_segments: int) -> None:
        """Map `n_segments` free budget units at the end of `region`; all or nothing."""
        picked = [i for i, o in enumerate(self._owner) if not o][:n_segments]
        start = region.n_segments
        done = 0
        try:
            for k in range(n_segments):
                region._aspace.map((start + k) * self.segment_bytes, self.segment_bytes)
                done += 1
        except BaseException:
            for k in range(done):
                region._aspace.unmap((start + k) * self.segment_bytes, self.segment_bytes)
            raise
        for i in picked:
            self._owner[i] = region.name
        region.segments.extend(picked)

    def _unmap(self, region: Region, n_segments: int) -> None:
        """Unmap the last `n_segments` of `region` and free their budget units."""
        for _ in range(n_segments):
            k = region.n_segments - 1
            region._aspace.unmap(k * self.segment_bytes, self.segment_bytes)
            self._owner[region.segments.pop()] = ""

    def _changed(self) -> None:
        self._seq += 1
        if self.on_change is not None:
            self.on_change(self.snapshot())
