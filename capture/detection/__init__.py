"""Stage 4 of capture: the per-step decision: the step's numbers read on the host (one transfer, one all-reduce
across ranks), the detectors asked, a trigger turned into an Incident.
"""
