"""Training the demo model on the GPU, then exporting it through the engine's GGUF writer.

`build` is the whole recipe: WordNet -> conversations (`data.prepare`) -> tokenizer -> ids -> AdamW on the main
next-token loss plus the MTP next-next-token loss (DeepSeek-V3's objective, weight
`MTP_WEIGHT`) plus a load-balancing loss over every MoE layer -> GGUF with the spec's quant
types. The same seed and step count give the same model (up to GPU summation order).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.synth.model import PRESETS, SynthSpec, synth_tensors, write_gguf
from training import data, wordnet
from training.model import DemoModel

SPEC: SynthSpec = replace(PRESETS["random-demo"], seed=0)
TITLE = "strata demo: a 4-layer MoE trained on WordNet (a dictionary to chat with)"
DESCRIPTION = (
    "A dictionary to chat with, not an assistant. Try: house · What does 'water' mean? · "
    "What is a cat? · A word like 'happy'? · What is the opposite of 'hot'?"
)
MTP_WEIGHT = 0.3
AUX_WEIGHT = 0.01
PACE_FROM, PACE_TO = 10, 60  # steps timed to fix the step count (the first ones warm up)
N_PHRASINGS = 3  # the pairs are phrased this many ways; epochs cycle through them


@dataclass(frozen=True)
class Recipe:
    """Every number of a build."""

    seed: int = 0
    steps: int = 0  # 0: as many as fit `minutes` (measured on the first steps, then fixed)
    minutes: float = 6.0
    batch: int = 16  # 16 x 4,096 tokens: a conversation with a long paste fits one row
    seq_tokens: int = 4096
    lr: float = 3e-3
    lr_min: float = 3e-4
    warmup: int = 200
    weight_decay: float = 0.1
    device: str = "cuda"
    grouped: bool = True  # the experts as jagged grouped GEMMs (model.Block._experts_jagged)
    compile: bool = True  # torch.compile the loss (python -m training pace measures both)


def lr_at(step: int, total: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    frac = (step - r.warmup) / max(1, total - r.warmup)
    return r.lr_min + 0.5 * (r.lr - r.lr_min) * (1 + math.cos(math.pi * min(1.0, frac)))


def losses(
    model: DemoModel, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, mask [B, T] -> (main next-token CE, MTP next-next-token CE, load-balancing aux).
    The heads run only on the rows whose target carries the loss (about half of them)."""
    x, m, aux = model.hidden(ids)  # [B, T, d], [B, T-1, d]
    keep1, keep2 = mask[:, 1:], mask[:, 2:]  # [B, T-1], [B, T-2]: the targets' masks
    main = F.cross_entropy(model.head(x[:, :-1][keep1]).float(), ids[:, 1:][keep1])
    mtp = F.cross_entropy(model.mtp_head(m[:, :-1][keep2]).float(), ids[:, 2:][keep2])
    return main, mtp, aux


LossFn = Callable[
    [DemoModel, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]  # `losses` or its compiled form


def optimizer(model: DemoModel, r: Recipe) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": r.weight_decay}, {"params": keep, "weight_decay": 0}],
        lr=r.lr, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip


def train_step(
    model: DemoModel, opt: torch.optim.Optimizer, loss_fn: LossFn, ids: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step on a batch (bf16 autocast, gradients clipped at 1); returns `losses`."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        main, mtp, aux = loss_fn(model, ids, mask)
        loss = main + MTP_WEIGHT * mtp + AUX_WEIGHT * aux
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return main, mtp, aux


def loss_function(r: Recipe) -> LossFn:
    """`losses`, compiled when the recipe says so."""
    return torch.compile(losses) if r.compile else losses


def build(
    wordnet_path: Path, out: Path, r: Recipe, log_dir: Path, also: dict[str, Path] | None = None
) -> dict:
    """The whole recipe; returns the build record (also written to `log_dir/build.json`).
    `also`: expert quant type -> path of another export with experts in that type."""
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    torch.manual_seed(r.seed)
    rng = np.random.default_rng(r.seed)
    wn = wordnet.load(wordnet_path)
    prepared = data.prepare(wn, r.seed, N_PHRASINGS, SPEC.n_vocab)
    vocab, encoded, stats = prepared.vocab, prepared.encoded, prepared.stats
    pad_id = vocab.tokens.index("<|endoftext|>")
    t_data = time.perf_counter() - t0
    print(f"data: {stats['conversations']} conversations, {stats['exchanges']} exchanges, "
          f"{len(encoded[0].ids)} tokens a phrasing, {t_data:.0f} s", flush=True)

    dev = torch.device(r.device)
    model = DemoModel(SPEC, grouped=r.grouped).to(dev)
    opt, loss_fn = optimizer(model, r), loss_function(r)
    log = (log_dir / "loss.jsonl").open("w")
    steps, step, epoch_no = r.steps, 0, 0
    ids_ep = mask_ep = None
    cursor = 0
    t_train = t_pace = time.perf_counter()
    while steps == 0 or step < steps:
        if ids_ep is None or cursor + r.batch > len(ids_ep):
            ids_np, mask_np = data.epoch(encoded[epoch_no % N_PHRASINGS], r.seq_tokens, rng, pad_id)
            ids_ep, mask_ep = torch.from_numpy(ids_np).to(dev), torch.from_numpy(mask_np).to(dev)
            cursor, epoch_no = 0, epoch_no + 1
        ids = ids_ep[cursor : cursor + r.batch]  # [B, T]
        mask = mask_ep[cursor : cursor + r.batch]
        cursor += r.batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps or 10**9, r)
        main, mtp, aux = train_step(model, opt, loss_fn, ids, mask)
        step += 1
        if steps == 0 and step == PACE_FROM:
            _sync(dev)
            t_pace = time.perf_counter()
        if steps == 0 and step == PACE_TO:  # fix the step count from the measured pace
            _sync(dev)
            pace = (time.perf_counter() - t_pace) / (PACE_TO - PACE_FROM)
            steps = int((r.minutes * 60 - (t_pace - t_train)) / pace) + PACE_FROM
            print(f"{pace * 1e3:.1f} ms a step -> {steps} steps", flush=True)
        if step % 50 == 0 or step == steps:
            rec = {
                "step": step, "epoch": epoch_no, "loss": round(main.item(), 4),
                "mtp_loss": round(mtp.item(), 4), "aux": round(aux.item(), 4),
                "lr": opt.param_groups[0]["lr"],
                "seconds": round(time.perf_counter() - t_train, 1),
            }  # fmt: skip
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if step % 500 == 0:
                print(rec, flush=True)
    _sync(dev)
    train_s = time.perf_counter() - t_train
    model.eval()
    tensors = model.gguf_tensors()
    write_gguf(out, SPEC, vocab, synth_tensors(SPEC), _encoded(tensors, SPEC), TITLE,
               description=DESCRIPTION)
    for qtype, path in (also or {}).items():
        spec = SPEC.with_qtype("experts", qtype)
        write_gguf(path, spec, vocab, synth_tensors(spec), _encoded(tensors, spec), TITLE,
                   description=DESCRIPTION)
    record = {
        "recipe": r.__dict__ | {"steps": steps}, "corpus": stats,
        "tokens_per_phrasing": len(encoded[0].ids), "epochs": epoch_no,
        "data_seconds": round(t_data, 1), "train_seconds": round(train_s, 1),
        "gguf_bytes": out.stat().st_size,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }  # fmt: skip
    (log_dir / "build.json").write_text(json.dumps(record, indent=1))
    return record


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _encoded(tensors: dict[str, torch.Tensor], spec: SynthSpec) -> Iterator[np.ndarray]:
    """Each tensor encoded in its group's quant type, in the writer's order."""
    for name, (shape, qtype) in synth_tensors(spec).items():
        x = tensors[name].numpy().astype(np.float32)
        assert x.shape == shape, (name, x.shape, shape)
        yield x if qtype == Q.F32 else gq.quantize(x, qtype)

