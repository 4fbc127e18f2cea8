"""Kits: what load_model returns (text and vision), their request registry and image decoding."""
