"""Every Python snippet in README.md and docs/*.md runs as written; the configuration reference is current.

Every ```python block of those documents is a test case (a block that is not meant to run has a plain ``` fence), and
none is skipped: a snippet whose framework is not installed fails, naming the extra to install (CI installs
`.[dev]`, which has them all). Each snippet runs in its own process (frameworks keep global state;
tests/fork_server.py forks it from a server that imported torch and transformers once) after a prelude that makes the
names the documents say the reader brings: `model` (a tiny random GPT-2), `optimizer`, `scheduler`, `scaler`,
`dataset` (one sample is corrupt), `batch_loader`, `loader`, `device`. The corrupt sample must stop the run with
TrainingFaultError and leave a dump that `forensics verify` accepts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import os, sys, torch
sys.path.insert(0, {examples!r})
import _common as common
from forensics.capture import IndexedDataset
from torch.utils.data import default_collate
torch.manual_seed(0)
device = "cpu"
model = common.tiny_gpt2()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.warmup)
scaler = torch.amp.GradScaler(device, enabled=False)
dataset = common.EmbedsDataset(24, poison=9)
batch_loader = torch.utils.data.DataLoader(IndexedDataset(dataset), batch_size=2)
indexed = IndexedDataset(dataset)
loader = [[default_collate([indexed[i], indexed[i + 1]]) for i in (start, start + 2)] for start in range(0, 24, 4)]
"""

DISTRIBUTED = """
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
"""


DOCUMENTS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

FRAMEWORKS = {
    "accelerate": "accelerate",
    "deepspeed": "deepspeed",
    "pytorch_lightning": "lightning",
    "transformers": "demo",
}  # a module a snippet imports -> the extra that installs it


def _snippets(document: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / document).read_text(), re.S | re.M)


def _needs(code: str) -> str | None:
    """The framework the snippet imports, if any (its test needs it installed)."""
    for module in FRAMEWORKS:
        if re.search(rf"^\s*(import|from) {module}\b", code, re.M):
            return module
    return None


SNIPPET_TIMEOUT = 120  # seconds: a snippet takes 5-15 s alone, a few times that on a busy 2-core machine


def _fork_server():
    from forensics_test_helpers import fork_server  # tests/helpers.py

    return fork_server()


CASES = [(document, index) for document in DOCUMENTS for index in range(len(_snippets(document)))]


def test_every_python_block_is_a_case_and_no_other_fence_hides_one():
    """A block fenced ```py / ```python3 / ```pycon would be Python that never runs: it is ```python (it runs) or
    a plain ``` fence (a fragment, a signature, an API sketch)."""
    assert {d for d, _ in CASES} >= {"README.md", "docs/INTEGRATIONS.md"}
    hidden = [
        f"{document}: ```{language}"
        for document in DOCUMENTS
        for language in re.findall(r"^```(\w+)", (ROOT / document).read_text(), re.M)
        if language.lower() in ("py", "python3", "pycon", "ipython") or language == "Python"
    ]
    assert not hidden, hidden


@pytest.mark.parametrize("document, index", CASES, ids=[f"{d}#{i}" for d, i in CASES])
def test_snippet_runs_as_written_and_dumps_the_corrupt_step(document, index, tmp_path):
    import importlib.util

    code = _snippets(document)[index]
    needs = _needs(code)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.fail(
            f"{document} snippet {index} imports {needs}: pip install -e '.[{FRAMEWORKS[needs]}]' "
            "(or '.[dev]') to run it"
        )
    prelude = PRELUDE.format(examples=str(ROOT / "scripts" / "examples"))
    if "DistributedDataParallel" in code or "deepspeed" in code or "fully_shard" in code:
        from forensics_test_helpers import free_port  # tests/helpers.py

        prelude += DISTRIBUTED.format(port=free_port())
    if "deepspeed" in code:  # without DeepSpeed's CPU shared-memory op: tests/integrations/deepspeed_rank.py says why
        prelude += "import deepspeed.ops\ndeepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False\n"
    if needs == "pytorch_lightning":  # the snippet's `module` and the recipe it names: the user's code
        prelude += "module = common.lit_gpt2()\n"
    script = (
        prelude
        + "\nfrom forensics.core.errors import TrainingFaultError\ntry:\n"
        + "\n".join("    " + line for line in code.splitlines())
        + "\nexcept TrainingFaultError as fault:\n    print('DUMP', fault.dump_path)\n"
    )
    (tmp_path / "snippet.py").write_text(script)
    server = _fork_server()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "DS_ACCELERATOR": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
    }
    try:
        done = server.shared(ROOT).run(
            tmp_path / "snippet.py",
            [],
            cwd=tmp_path,
            env=env,
            out_dir=tmp_path / "out",
            timeout=SNIPPET_TIMEOUT,
            preload=["deepspeed"] if needs == "deepspeed" else [],
        )
    except server.Timeout as hung:
        pytest.fail(
            f"the snippet hung: no exit within {SNIPPET_TIMEOUT} s\n{hung.stdout[-3000:]}\n{hung.stderr[-3000:]}"
        )
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 0, stdout[-3000:] + stderr[-5000:]
    dumped = [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("DUMP ")]
    assert dumped and dumped[0] != "None", stdout[-2000:] + stderr[-3000:]
    from forensics.format import verify_dump

    assert verify_dump(tmp_path / dumped[0]).ok


def test_the_configuration_reference_is_current():
    from scripts import config_reference

    assert (ROOT / "docs" / "CONFIGURATION.md").read_text() == config_reference.render(), (
        "docs/CONFIGURATION.md is not current: run python -m scripts.config_reference"
    )
