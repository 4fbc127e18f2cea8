"""Loading models: finding, checking and reading files (HF layout and GGUF) into a model and tokenizer."""
