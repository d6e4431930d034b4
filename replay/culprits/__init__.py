"""Stage 4, culprits: which samples make the step fail (bisection), their per-sample losses and gradient norms, and
what is odd in their own data or size. Nothing is re-exported."""
