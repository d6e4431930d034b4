"""Runs torchtitan's trainer as `torchrun -m forensics.capture.integrations.torchtitan` does, from a script path (the fork
server of the tests starts scripts: tests/fork_server.py)."""

from forensics.capture.integrations.torchtitan import main

main()
