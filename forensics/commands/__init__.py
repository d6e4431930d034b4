"""What the CLI's commands call beyond the replay and the format: `inspect`'s summary of a dump, `list`'s catalog."""
