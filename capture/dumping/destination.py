"""Where the Guard's dumps go, checked when the Guard is built, so that a `dump_dir` it cannot use is said then and
never at the faulty step (where a failure must not change what the policy does to the step).

- A URL carrying a credential (`s3://KEY:secret@...`, `?token=...`) or whose filesystem package is not installed
  (`gs://` without gcsfs): ValueError when the Guard is built, saying what to do instead. The job has not started.
- A store that gives no answer within DumpConfig.storage_timeout (an unreachable or hung endpoint, no credentials
  found): logged, and the dumps go to DumpConfig.fallback_dir on this machine; with fallback_dir None, ValueError.
  A store that answers "not found" or "access denied" for the prefix is reachable: the prefix appears with the
  first dump, and a write refused later is logged at that dump (the policy still applies).
- A local directory is used as given (an unwritable one is said at the dump, as before).

Each rank checks on its own: a rank whose store does not answer writes locally, the others still to the store.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from forensics.capture.config import DumpConfig
from forensics.core.errors import StorageError
from forensics.format.location import Location, RemotePath, StorageTimeouts, as_location, is_url

log = logging.getLogger(__name__)


def dump_root(dump_dir: str, dumping: DumpConfig) -> Location:
    """The location the Guard writes its dumps under: `dump_dir`, or `dumping.fallback_dir` when its store does not
    answer (see the module docstring).

    Raises:
        ValueError: the URL carries a credential, its filesystem package is missing, or (fallback_dir None) the
            store does not answer.
    """
    if not is_url(dump_dir):
        return as_location(dump_dir)
    try:
        root = as_location(dump_dir, dumping.storage_timeouts())
    except StorageError as exc:
        raise ValueError(f"GuardConfig.dump_dir cannot be used: {exc}") from None
    if not isinstance(root, RemotePath):  # a file:// URL: a local directory
        return root
    problem = unreachable(root, dumping.storage_timeout)
    if problem is None:
        return root
    if dumping.fallback_dir is None:
        raise ValueError(
            f"GuardConfig.dump_dir {root}: {problem}. Check the endpoint and the credentials in the environment, or "
            "set DumpConfig.fallback_dir to a local directory for the dumps to go to meanwhile"
        )
    fallback = Path(dumping.fallback_dir)
    log.error(
        "forensics: the dump location %s cannot be used: %s. Dumps of this process go to %s on this machine instead "
        "(DumpConfig.fallback_dir); the policy of each faulty step is applied as configured",
        root,
        problem,
        fallback.resolve(),
    )
    return fallback


def unreachable(root: RemotePath, wait_s: float) -> str | None:
    """Why the store holding `root` cannot be used (no answer within `wait_s` seconds, no credentials found, the
    library failing), or None when it answered — "not found" and "access denied" are answers. Waits at most
    `wait_s` (plus a second) whatever the storage library does: the lookup runs on a daemon thread."""
    outcome: list[str | None] = []

    def look() -> None:
        try:
            root.exists()
            outcome.append(None)
        except OSError:  # the store answered: no such bucket, access denied
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - StorageError: no credentials, an endpoint that refused
            outcome.append(str(exc))

    thread = threading.Thread(target=look, name="forensics-dump-dir-check", daemon=True)
    thread.start()
    thread.join(wait_s + 1.0)
    if not outcome:
        return f"no answer within {wait_s:g} s (DumpConfig.storage_timeout)"
    return outcome[0]


__all__ = ["StorageTimeouts", "dump_root", "unreachable"]
