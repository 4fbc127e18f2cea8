"""Training and evaluating the bundled toy model pair (see docs/demo-models.md)."""
