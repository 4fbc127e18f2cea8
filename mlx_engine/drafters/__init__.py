"""Every drafter behind the loop's one interface (``decode.protocol.Drafter``): the
draft model (``draft_model.py``), hidden-state heads (``head.py``), prompt lookup
(``prompt_lookup.py``), the suffix memory (``suffix.py``), the automatic router
that chooses between them per request (``router.py``; its rules in ``routing.py``,
one proposer per mode in ``proposers.py``) with its shadow scoring
(``shadow.py``), and the draft-length policy (``policy.py``; what the draft
model's and a head's drafters share around it in ``policy_drafter.py``)."""
