"""Stage 2, run: re-execute the dumped step from its pre-step state (`execute.StepRunner`), check whether it needs
the dump's RNG, and re-execute the recorded steps before it (window replay). Nothing is re-exported."""
