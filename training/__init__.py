"""Builds the shipped demo model: WordNet -> chat pairs -> BPE tokenizer -> PyTorch MoE + MTP
-> GGUF. A development tool (the `train` extra, PyTorch on a GPU machine); `engine/` and `app/`
never import it."""
