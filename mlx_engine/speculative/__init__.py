"""Decoding strategies. One verify/accept/rewind loop (``loop.py``) serves every
drafter: a draft model (``draft_model.py``; checked and loaded by
``draft_loading.py``), prompt lookup (``prompt_lookup.py``), the suffix memory
(``suffix.py``) and the automatic router (``router.py``) that chooses between
them per request. The draft length is priced by ``policy.py``, ``costs.py``
(forward costs, round times) and ``speedup.py`` (acceptance, expected speed-up)."""

from .loop import Drafter, DrafterUnavailable, Step, decode

__all__ = ["Drafter", "DrafterUnavailable", "Step", "decode"]
