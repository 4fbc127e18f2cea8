"""What speculation costs and earns: forward costs measured and fitted
(``costs.py``, with the statistics of ``fit.py``), stored per machine
(``cost_store.py``), refined from timed rounds (``cost_book.py``), measured in
the background (``cost_background.py``), the batch's prices
(``batch_pricing.py``) and the expected speed-up (``speedup.py``)."""
