"""Stage 3, localise: where the step first fails — the module / op in forward and backward, the parameter the
update breaks, the op that raised, the weights already non-finite before the step. Nothing is re-exported."""
