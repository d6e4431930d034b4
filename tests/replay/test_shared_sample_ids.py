"""A bad record carrying the ID of two good ones: the job's record_batch warns (once per step), the report shows the
shared ID and where it lies, blame keeps to positions, and the blocklist never lists the ID (filtering it would drop
the two healthy samples); the verdict says why, naming the culprit by its position."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from forensics.cli import main

IDS = ["a", "b", "x", "c", "x", "d", "x", "e"]
BAD = 4  # the record with the non-finite value; positions 2 and 6 are healthy records sharing its ID


@pytest.fixture(scope="module")
def shared_id_dump(tmp_path_factory):
    """A real Guard crash dump of a tiny GPT-2 whose batch of 8 holds one bad record (an inf in its embeddings),
    with the ID "x" that two good records of the step carry too; the job's log kept."""
    import torch
    import transformers

    from forensics.capture import Guard, GuardConfig
    from forensics.core.errors import TrainingFaultError

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    root = tmp_path_factory.mktemp("shared_ids")
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(root), run_id="shared"))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("forensics").addHandler(handler)
    try:
        with pytest.raises(TrainingFaultError) as err:
            for step in range(3):
                ids = torch.randint(1, 32, (8, 8), generator=torch.Generator().manual_seed(step))
                embeds = model.transformer.wte(ids).detach()
                if step == 2:
                    embeds[BAD, 3, 5] = float("inf")
                for half in (slice(0, 4), slice(4, 8)):  # two micro-batches: "x" repeats within and across them
                    batch = {"inputs_embeds": embeds[half], "labels": ids[half], "sample_ids": IDS[half]}
                    guard.record_batch(batch)
                    loss = model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
                    guard.record_loss(loss)
                    loss.backward()
                if guard.check():
                    optimizer.step()
                optimizer.zero_grad()
        guard.close()
    finally:
        logging.getLogger("forensics").removeHandler(handler)
    return Path(err.value.dump_path), [r.getMessage() for r in records]


def test_record_batch_warns_once_per_step(shared_id_dump):
    _, messages = shared_id_dump
    repeats = [m for m in messages if "names more than one sample of this step" in m]
    assert len(repeats) == 3, messages  # one per step, though "x" repeats three times in each
    assert "'x'" in repeats[0] and "micro-batch 2, position 0" in repeats[0]  # micro-batches counted from 1


def test_the_report_shows_the_shared_id_and_the_blocklist_leaves_it_out(shared_id_dump, tmp_path, caplog):
    dump, _ = shared_id_dump
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["replay", str(dump), "--device", "cpu", "--no-remedies", "-o", str(out)])
    assert result.exit_code in (0, 3, 4), (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    [warning] = [w for w in report["environment"]["warnings"] if "name more than one sample" in w]
    assert "'x' at micro-batch 1 sample 2, micro-batch 2 samples 0 and 2" in warning
    blamed = report["culprit"]["samples"]
    assert [(s["micro_batch"], s["index"]) for s in blamed] == [(1, 0)]  # the bad record's position alone
    assert blamed[0]["sample_id"] == "x"
    assert blamed[0]["shared_with"] == [{"micro_batch": 0, "index": 2}, {"micro_batch": 1, "index": 2}]
    blocklist = out / "blocklist.jsonl"
    assert not blocklist.exists() or "x" not in [json.loads(line) for line in blocklist.read_text().splitlines()]
    words = " ".join(report["verdict"]["suggestions"])
    assert "No blocklist entry for 'x' (micro-batch 2, sample 0)" in words
    assert "blocklist.jsonl lists" not in words + report["verdict"]["explanation"]
    assert "not every record with its ID" in words  # "Filter 'x'" says the record, not the ID
    markdown = (out / "report.md").read_text()
    assert "name more than one sample" in markdown  # shown to the reader, not only in the JSON


def test_record_batch_is_quiet_for_distinct_ids_and_ids_it_cannot_compare(caplog):
    import torch

    from forensics.capture.recording.recorder import StepRecorder

    recorder = StepRecorder("sample_ids", lambda: None)
    for ids in (["a", None, None], ["b", "c", None], torch.tensor([1, 2, 3]), [{"k": 1}, {"k": 1}]):
        recorder.batch({"x": torch.zeros(3, 2), "sample_ids": ids})
    assert "names more than one sample" not in caplog.text  # Nones name no sample; dicts are not compared
    recorder.batch({"x": torch.zeros(2, 2), "sample_ids": torch.tensor([7, 3])})  # tensor of IDs: 3 repeats
    assert caplog.text.count("names more than one sample") == 1 and "sample ID 3 " in caplog.text
