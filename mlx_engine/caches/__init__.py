"""Caches: one sequence's KV cache, the prompt cache of several sequences, its disk tier, a batch's rows."""
