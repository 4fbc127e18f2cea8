"""GGUF files: the header and tensors, families mapped onto mlx-lm classes, tokenizers."""
