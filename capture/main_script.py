"""The training script's source, recorded for a loss or model factory defined in it (`python train.py`).

Such a function is named `__main__:lm_loss`, which replay cannot import: `__main__` there is forensics, and
importing `train` instead would run the script's training again. So the Guard reads the script once, when it
is created (what the job runs, not a later edit), and each dump holds it as `main_script.py` (size-capped);
replay defines the function from it, behind --trust, without running its top-level training code
(replay/load/main_script.py).
"""

from __future__ import annotations

import logging
import os
import sys

from forensics.format import spec

log = logging.getLogger(__name__)

MAIN_PREFIX = "__main__:"


def uses_main(recipe: dict) -> bool:
    """The recipe's loss or factory is defined in the training script."""
    return any(isinstance(recipe.get(key), str) and recipe[key].startswith(MAIN_PREFIX) for key in ("loss", "factory"))


class MainScript:
    """The script's bytes (or why there are none) for dumps whose recipe names `__main__`."""

    def __init__(self, recipe: dict):
        self.source: bytes | None = None
        self.name = "the training script"
        self.why_missing: str | None = None
        if uses_main(recipe):
            self._read()

    def _read(self) -> None:
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        if not path or not os.path.isfile(path):
            self.why_missing = "the job's __main__ is not a script file (an interactive session, python -c)"
        else:
            self.name = os.path.basename(path)
            try:
                size = os.path.getsize(path)
                if size > spec.MAX_MAIN_SCRIPT:
                    self.why_missing = f"{self.name} is {size} bytes, over the {spec.MAX_MAIN_SCRIPT} recorded"
                else:
                    with open(path, "rb") as file:
                        self.source = file.read(spec.MAX_MAIN_SCRIPT + 1)[:spec.MAX_MAIN_SCRIPT]
            except OSError as exc:
                self.why_missing = f"{self.name} could not be read ({type(exc).__name__}: {exc})"
        if self.why_missing:
            log.warning("forensics: the loss or model factory is defined in the training script, but %s: replay will "
                        "need it in an importable module (--loss module:fn)", self.why_missing)

    def describe(self, recipe: dict) -> dict:
        """The manifest's recipe, with `script` naming the recorded source (docs/DUMP_FORMAT.md `recipe`)."""
        if not uses_main(recipe):
            return recipe
        recipe = dict(recipe)
        if self.source is not None:
            recipe["script"] = {"file": spec.MAIN_SCRIPT, "name": self.name}
            recipe["note"] = (f"defined in the training script {self.name}, whose source the dump holds: replay --trust "
                              "defines it from there without running the script's training code")
        else:
            recipe["note"] = (f"defined in the training script, which the dump does not hold ({self.why_missing}): "
                              "move it into a module and replay with --loss module:fn --path DIR")
        return recipe

    def files(self) -> dict[str, bytes]:
        """The dump's extra file holding the script ({} when there is none)."""
        return {spec.MAIN_SCRIPT: self.source} if self.source is not None else {}
