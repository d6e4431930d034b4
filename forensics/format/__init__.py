"""The dump format (docs/DUMP_FORMAT.md): writer, lazy validating reader, verify, pack.

Names load on first use, so `forensics inspect` / `verify` never import torch for the manifest alone.
"""

from __future__ import annotations

from forensics.core.lazy import lazy_exports

_EXPORTS = {
    "Dump": "forensics.format.reader",
    "open_dump": "forensics.format.reader",
    "open_step": "forensics.format.reader",
    "DumpContent": "forensics.format.writer",
    "write_dump": "forensics.format.writer",
    "Problem": "forensics.format.verify",
    "VerifyResult": "forensics.format.verify",
    "verify_dump": "forensics.format.verify",
    "pack_dump": "forensics.format.pack",
    "Unreplayable": "forensics.format.batch_tree",
}

__all__ = list(sorted(_EXPORTS))  # a list literal's type for linters


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
