"""GGUF reading: memory-mapped files, tensor-name tables, hyper-parameters, tokenizer,
quant layouts (CPU dequantization, `ExpertLayout`)."""
