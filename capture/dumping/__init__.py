"""Stage 5 of capture: an Incident written as a dump: budgets, the manifest's environment, recipe and script,
background writes and uploads.
"""
