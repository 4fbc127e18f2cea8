"""The one verify/accept/rewind loop (``loop.py``) every decoding mode runs, what
it exchanges with its caller and its drafter (``protocol.py``: launches, rounds,
steps, the ``Drafter`` interface), the sampler and logits processors it draws
with (``sampling.py``), and the target's hidden states read out of its forward
pass for hidden-state drafters (``capture.py``). Drafters live in
``mlx_engine/drafters/``, their prices in ``mlx_engine/pricing/``."""

from .loop import decode
from .protocol import Drafter, DrafterUnavailable, Step

__all__ = ["Drafter", "DrafterUnavailable", "Step", "decode"]
