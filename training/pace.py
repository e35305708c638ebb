"""`python -m training pace`: the training step's time on the GPU for each way to run it.

A build's minutes are fixed, so the step time decides how many epochs the demo sees. This
times `train.train_step` on random tokens (the build's batch and row length, half the targets
carrying the loss) for the expert GEMMs padded or jagged and the loss eager or compiled, each
after its own warm-up, and prints a table: median and range of the timed steps, and tokens a
second. `--profile` adds the CUDA kernels of one step of each variant, the largest first.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from training.model import DemoModel
from training.train import SPEC, Recipe, loss_function, optimizer, train_step

WARMUP = 8  # steps before timing: compilation, cuBLAS heuristics, the allocator's pools


def _warm_step(r: Recipe, seed: int = 0) -> Callable[[], None]:
    """One training step of recipe `r` (its `grouped` and `compile`) on fixed random tokens
    (the build's shapes, half the targets carrying the loss), after WARMUP such steps."""
    torch.manual_seed(seed)
    dev = torch.device(r.device)
    model = DemoModel(SPEC, grouped=r.grouped).to(dev)
    opt, loss_fn = optimizer(model, r), loss_function(r)
    ids = torch.randint(0, SPEC.n_vocab, (r.batch, r.seq_tokens), device=dev)  # [B, T]
    mask = torch.rand(r.batch, r.seq_tokens, device=dev) < 0.5  # [B, T]

    def step() -> None:
        train_step(model, opt, loss_fn, ids, mask)

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    return step


def time_variant(r: Recipe, steps: int, seed: int = 0) -> list[float]:
    """Seconds of each of `steps` timed steps of recipe `r`."""
    step, out = _warm_step(r, seed), []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def kernels(r: Recipe, top: int = 20) -> str:
    """The CUDA kernels of one step (after a warm-up), by total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    step = _warm_step(r)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def main(steps: int, batch: int, seq_tokens: int, profile: bool) -> int:
    """Print the table of every variant; 1 without a CUDA device."""
    if not torch.cuda.is_available():
        print("python -m training pace: no CUDA device (the pace is the GPU's)")
        return 1
    base = replace(Recipe(), batch=batch, seq_tokens=seq_tokens)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {batch} x "
          f"{seq_tokens} tokens, {steps} steps timed after {WARMUP}\n")
    print("| experts | loss | ms a step (median) | range | tokens/s |")
    print("|---|---|---:|---:|---:|")
    tables = []
    for grouped, compiled in itertools.product((False, True), (False, True)):
        r = replace(base, grouped=grouped, compile=compiled)
        label = ("jagged" if grouped else "padded", "compiled" if compiled else "eager")
        try:
            ts = time_variant(r, steps)
        except Exception as e:  # a variant torch cannot run here: say so, time the others
            print(f"| {label[0]} | {label[1]} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
            continue
        med = statistics.median(ts)
        print(f"| {label[0]} | {label[1]} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f}-"
              f"{max(ts) * 1e3:.1f} | {batch * seq_tokens / med:,.0f} |", flush=True)
        if profile:
            tables.append((label, kernels(r)))
    for label, table in tables:
        print(f"\n## {label[0]} experts, {label[1]} loss\n\n{table}")
    return 0
