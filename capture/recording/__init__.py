"""Stage 1 of capture: what the Guard keeps of the step as it runs (micro-batches, sample IDs, RNG, losses) and
of the steps before it (history, flight recorder).
"""
