"""Files shipped with the engine.

`demo.gguf` is the default model: a 4-layer qwen3moe (32 experts, top-4, width 256) with one
MTP layer, trained by this project on WordNet 3.0 (`training/`, docs/demo-model.md). It is a
dictionary to chat with, not an assistant.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL = Path(__file__).with_name("demo.gguf")
DEMO_DESCRIPTION = "a 4-layer MoE trained on WordNet: a dictionary to chat with, not an assistant"
