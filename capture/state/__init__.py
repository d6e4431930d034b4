"""Stage 2 of capture: the training state a dump holds: name-keyed host data, the sharded layout, buddy copies,
the pre-forward buffers and the periodic host snapshots.
"""
