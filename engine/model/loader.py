"""Load a qwen3moe or glm4moe GGUF into a ready-to-run `Model`: hyper-parameters, weights,
tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.backend import DEFAULT_SIM_BYTES, SimBackend
from engine.backend.base import Backend
from engine.errors import ModelError
from engine.experts.host import FileExperts
from engine.gguf.hparams import HParams, read_hparams
from engine.gguf.reader import ModelFile, open_gguf
from engine.gguf.tokenizer import Tokenizer
from engine.gguf.weight_values import check_values
from engine.model.transformer import Transformer
from engine.model.weights import dense_bytes


@dataclass
class Model:
    """Read-only weights of one model file. Run-state (KV, caches) lives elsewhere."""

    path: Path
    mf: ModelFile
    hp: HParams
    tokenizer: Tokenizer
    transformer: Transformer | None  # None until `build` (weights decoded onto the device)
    experts: FileExperts  # routed experts of the main blocks with experts (`hp.n_moe_layer`)
    mtp_experts: FileExperts | None  # routed experts of the MTP block, if any
    dense_bytes: int

    @property
    def has_mtp(self) -> bool:
        return self.hp.n_nextn > 0

    def build(self, backend: Backend, to_device: Callable | None = None,
              head_to_device: Callable | None = None, quantized: bool = False) -> None:
        """Put the dense weights on `backend` (into ledger regions via `to_device`; by default
        new device arrays); `quantized`: linear weights stay in their blocks (`--dense quant`)."""
        to_device = to_device or backend.to_device
        self.transformer = Transformer(self.mf, self.hp, backend, to_device, head_to_device,
                                       quantized=quantized)


def load_model(path: str | Path, backend: Backend | None = None, build: bool = True) -> Model:
    """Open and validate `path`; with `build`, decode the dense weights too, onto `backend`
    (default: a simulated device of the default size), else call `Model.build` once device
    memory is planned. Experts stay memory-mapped."""
    mf = open_gguf(path)
    hp = read_hparams(mf)
    check_values(mf)  # NaN or infinity in a norm or a scale would turn the reply into NULs
    tokenizer = Tokenizer.from_metadata(mf.metadata)
    if tokenizer.n_vocab != hp.n_vocab:
        raise ModelError(
            f"{mf.path.name}: tokenizer has {tokenizer.n_vocab} tokens but token_embd has "
            f"{hp.n_vocab} rows; the file is inconsistent"
        )
    tokenizer.check_chat_template(mf.path.name)
    model = Model(
        path=Path(path),
        mf=mf,
        hp=hp,
        tokenizer=tokenizer,
        transformer=None,
        experts=FileExperts(mf, range(hp.n_dense_lead, hp.n_layer)),
        mtp_experts=FileExperts(mf, range(hp.n_layer, hp.n_layer + hp.n_nextn)) if hp.n_nextn else None,
        dense_bytes=dense_bytes(mf, hp),
    )
    if build:
        model.build(backend or SimBackend(DEFAULT_SIM_BYTES))
    return model
