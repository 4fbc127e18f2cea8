"""The one verify/accept/rewind loop (``loop.py``) every decoding mode runs, the
sampler and logits processors it draws with (``sampling.py``), and the target's
hidden states read out of its forward pass for hidden-state drafters
(``capture.py``). Drafters live in ``mlx_engine/drafters/``, their prices in
``mlx_engine/pricing/``."""

from .loop import Drafter, DrafterUnavailable, Step, decode

__all__ = ["Drafter", "DrafterUnavailable", "Step", "decode"]
