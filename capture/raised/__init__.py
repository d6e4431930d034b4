"""Stage 6 of capture: a step that raised instead of finishing: where it raised, and its dump."""
