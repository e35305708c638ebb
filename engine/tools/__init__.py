"""Benchmarks and diagnostics: `strata bench` (and `--forecast`), `strata bench-serve`, the kernel
microbenchmarks, a decode step's GPU time by part, and fitting a synthetic model's MTP block.
The serving path never imports them: the CLI sub-commands and `python -m` run them."""
