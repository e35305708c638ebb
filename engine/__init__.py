"""strata-chat engine: MoE GGUF inference with a request-scoped VRAM loan for prompt prefill."""

import os

# Our CPU matrix products are many small ones (one per routed expert); OpenBLAS threads cost
# more than they give there (measured 7x slower with 2 threads on 128x256x256 products), and
# the app's UI thread needs the other core. Users can still override it.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

__version__ = "0.1.0"
