"""Stage 3 of capture: the precursor monitor (GuardConfig.precursors): per-block statistics of sampled steps and
the trends that announce a divergence.
"""
