"""The byte layout of the `experts.cache` region: the staged residency table (int32
[n_layer, n_expert], 256-byte aligned), then `n_slots` slots of one expert blob each.

The planner sizes the region from it and the expert cache carves it by it, so the two agree.
"""

from __future__ import annotations

import numpy as np

from engine.memory.sizes import align_up

TABLE_DTYPE = np.int32
TABLE_ALIGN_BYTES = 256


def residency_table_bytes(n_layer: int, n_expert: int) -> int:
    """Device bytes of a staged table: int32 [n_layer, n_expert], 256-byte aligned."""
    return align_up(n_layer * n_expert * np.dtype(TABLE_DTYPE).itemsize, TABLE_ALIGN_BYTES)


def cache_region_bytes(n_layer: int, n_expert: int, blob_bytes: int, n_slots: int) -> int:
    """Bytes of the `experts.cache` region: staged table plus `n_slots` blobs."""
    return residency_table_bytes(n_layer, n_expert) + n_slots * blob_bytes
