"""strata-chat engine: MoE GGUF inference with a request-scoped VRAM loan for prompt prefill."""

__version__ = "0.1.0"
