"""Stage 1, load: turn a dump into a live `ReplaySession` (model, optimizer, loss, batches, device, precision),
importing the code a dump names only with consent. Modules are imported by full path; nothing is re-exported."""
