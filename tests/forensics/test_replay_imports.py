"""What `forensics replay` imports before its first replayed step (names, not timings): only what the dump's model
needs. The demo's dump names the plain-torch GPT-2 (forensics.demo.models:tiny_gpt2), so neither transformers nor
torch._dynamo (which torch.optim and meta-device init would pull in: sympy, torch.distributed.tensor) nor the report's
matplotlib may be loaded when the step is first re-executed (BENCHMARKS.md "Replay's first step")."""

from __future__ import annotations

import json
import subprocess
import sys

from forensics.demo.run import SCENARIOS

# Run as `python -c`: a CLI replay whose stdout/stderr note sys.modules when the progress line of the first replayed
# step is written, and end the process there.
DRIVER = r"""
import json, os, sys

MARK, OUT = sys.argv[1], sys.argv[2]

class Watch:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if MARK in text:
            with open(OUT, "w") as handle:
                json.dump(sorted(sys.modules), handle)
            self.stream.flush()
            os._exit(0)
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)

sys.stdout, sys.stderr = Watch(sys.stdout), Watch(sys.stderr)
from forensics.cli import main
sys.argv = ["forensics", *sys.argv[3:]]
main()
"""

HEAVY = (
    "transformers",
    "transformers.integrations.hub_kernels",
    "torch._dynamo",
    "torch.distributed.tensor",
    "sympy",
    "matplotlib",
    "accelerate",
)


def test_replay_of_the_demo_dump_imports_nothing_heavy_before_its_first_step(tmp_path):
    captured = SCENARIOS["bad_sample"].capture(tmp_path / "demo")
    manifest = json.loads((captured.dump_path / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["recipe"]["factory"] == "forensics.demo.models:tiny_gpt2"

    seen = tmp_path / "modules.json"
    cmd = [sys.executable, "-c", DRIVER, "reproducing the step", str(seen)]
    cmd += ["replay", str(captured.dump_path), "-o", str(tmp_path / "report"), "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert seen.is_file(), f"no first replayed step (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    modules = set(json.loads(seen.read_text()))

    assert {"torch", "forensics.demo.gpt2", "forensics.replay.engine"} <= modules
    assert not [name for name in HEAVY if name in modules]
