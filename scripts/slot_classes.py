"""One slot size (the largest blob) against one slot size per layout class, for llama.cpp's
quant mixes of the 48-layer preset (docs/quant-mixes.md): `python -m scripts.slot_classes
[--ledger-mib 6430]`. The planner's startup plan on each mix's shapes (CUDA costs, `--mtp
--spec 2 --kv q4_0 --ctx 31400`); "per class" is the same cache bytes over the mean blob.
Pure arithmetic: no file, no device. Prints one markdown table."""

from __future__ import annotations

import argparse
from dataclasses import replace

from engine.backend.base import CUDA_TRAITS
from engine.config import EngineOptions, LoanFlags
from engine.memory.costs import Shapes, model_costs
from engine.memory.planner import plan_startup
from engine.memory.sizes import MiB
from engine.startup.device import plan_options_for
from engine.synth.model import PRESETS

MIXES = ("", "q4_k_m", "q5_k_m", "q3_k_m", "iq4_xs", "q2_k")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ledger-mib", type=int, default=6430, help="the ledger's bytes (8 GiB limit)")
    args = p.parse_args()
    opts = EngineOptions(model="preset", device="cuda", kv="q4_0", ctx=31400, mtp=True, spec=2)
    print("| mix | blob sizes (B) | slots of the largest | slots per layout class | unused |")
    print("|---|---|---:|---:|---:|")
    for mix in MIXES:
        shapes = Shapes.of_spec(replace(PRESETS["qwen3-30b-a3b"], mix=mix))
        costs = model_costs(shapes, opts, CUDA_TRAITS.weight_bytes, gpu=True, quant=True)
        plan = plan_startup(args.ledger_mib * MiB, costs,
                            plan_options_for(opts, LoanFlags(), 0, 64 * MiB, CUDA_TRAITS))
        sizes = shapes.layer_blob_bytes
        per_class = int(plan.n_cache_slots * shapes.blob_bytes // (sum(sizes) / len(sizes)))
        gain = per_class / plan.n_cache_slots - 1
        print(f"| {mix.upper() or 'Q4_0 (the preset)'} | "
              f"{' / '.join(f'{n:,}' for n in sorted(set(sizes)))} | {plan.n_cache_slots:,} | "
              f"{per_class:,} (+{gain:.1%}) | {shapes.slot_slack_share():.1%} |")


if __name__ == "__main__":
    main()
