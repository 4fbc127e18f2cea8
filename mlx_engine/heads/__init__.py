"""Hidden-state drafters: MTP and EAGLE-3 heads that draft from the target's
own hidden states (docs/decoding.md, *Hidden-state drafters*)."""
