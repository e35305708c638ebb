"""Synthetic qwen3moe models: deterministic weights and a word vocabulary, written as GGUF."""
