"""Stage 5, judge: fp32 triage, the fixes tried on the step, the loss history, then the verdict and the report
assembled from every stage's findings (and the reports of precursor and between-steps dumps). Nothing is re-exported."""
