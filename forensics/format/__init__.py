"""The dump format (docs/DUMP_FORMAT.md): writer, lazy validating reader, verify, pack."""

from forensics.format.pack import pack_dump
from forensics.format.reader import Dump, open_dump, open_step
from forensics.format.tree import Unreplayable
from forensics.format.verify import Problem, VerifyResult, verify_dump
from forensics.format.writer import DumpContent, write_dump

__all__ = ["Dump", "DumpContent", "Problem", "Unreplayable", "VerifyResult", "open_dump", "open_step",
           "pack_dump", "verify_dump", "write_dump"]
