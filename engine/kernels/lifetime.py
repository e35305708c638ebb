"""Device arrays the kernels keep for the whole process (lookup tables, RoPE frequencies).

They may first be asked for inside a prompt chunk's arena (engine/backend/cuda_arena.py), whose
memory is lent and refilled after the prompt; `process_lifetime()` makes CuPy allocate them
from its default pool instead.
"""

from __future__ import annotations

from typing import Any


def process_lifetime() -> Any:
    """A context in which CuPy allocates from its default pool, for device arrays cached for
    the whole process, even when first asked for inside an arena."""
    import cupy

    return cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc)
