"""The GPU natural-run verdict suite: make_dumps.py and the models, losses and data it trains (nothing planted)."""
