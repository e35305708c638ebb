"""GGUF reading: memory-mapped files, tensor-name tables, hyper-parameters, tokenizer."""
