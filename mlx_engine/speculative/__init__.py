"""Decoding strategies. One verify/accept/rewind loop (``loop.py``) serves every
drafter: a draft model (``draft_model.py``), prompt lookup (``prompt_lookup.py``)
and the automatic router (``router.py``) that chooses between them per request."""

from .loop import Drafter, DrafterUnavailable, Step, decode

__all__ = ["Drafter", "DrafterUnavailable", "Step", "decode"]
