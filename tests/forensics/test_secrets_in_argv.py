"""No credential on the job's command line reaches a dump, a pack, `inspect` or a report, in any spelling a command
line uses for one (forensics.core.redact): every byte of each is read for every planted secret. A dump an older
forensics wrote with the secrets in its manifest shows none either: the readers and `pack` redact it."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import zstandard
from click.testing import CliRunner
from forensics_test_helpers import edit_manifest

from forensics.cli import main
from forensics.core.redact import names_secret, redacted_argv

# Each secret is unique and appears nowhere else, so finding one anywhere is a leak.
SECRETS = {f"s{n}": f"Zq{n}x7Secretvalue{n:03d}" for n in range(1, 22)}
S = SECRETS
PLANTED_ARGV = [
    "train.py",
    f"hub.token={S['s1']}",  # Hydra
    f"+trainer.hf_token={S['s2']}",  # Hydra, appended key
    f"--config.wandb_api_key={S['s3']}",  # dotted flag
    "--hftoken",  # a flag whose value is the next argument, words run together
    S["s4"],
    f"HF_TOKEN={S['s5']}",  # env-style
    f"--dataset-url=https://hub.example.com/d?revision=main&token={S['s6']}",  # a query parameter
    f"https://{S['s7']}@huggingface.co/org/model",  # a token as a URL's user
    "https://bucket.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"  # presigned URL
    f"&X-Amz-Credential={S['s8']}%2F20260101&X-Amz-Security-Token={S['s9']}&X-Amz-Signature={S['s10']}",
    "--password",
    S["s11"],
    "-H",
    f"Authorization: Bearer {S['s12']}",  # a header
    f"--api_key={S['s13']}",
    f"--mirror=s3://user:{S['s14']}@bucket/x",  # a URL password
    "--json-config",
    json.dumps({"hf_token": S["s15"], "lr": 3}),  # JSON in one argument
    f"apiKey={S['s16']}",  # camelCase
    f"db.password={S['s17']}",
    "--aws-secret-access-key",
    S["s18"],
    f"hf_{S['s19']}abcdefghij",  # a Hugging Face token shape, bare
    f"ghp_{S['s20']}abcdefghijklmnop",  # a GitHub token shape, bare
    f"++optim.secret={S['s21']}",
    "--lr",
    "3e-4",
    "--tokenizer",
    "gpt2",
]


def leaks(data: bytes | str) -> list[str]:
    text = data if isinstance(data, str) else data.decode("utf-8", "replace")
    return [name for name, secret in SECRETS.items() if secret in text]


def every_file(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_redaction_keeps_what_is_no_secret():
    redacted = redacted_argv(PLANTED_ARGV)
    assert leaks(json.dumps(redacted)) == []
    assert redacted_argv(redacted) == redacted  # a reader or pack applying it again changes nothing
    assert redacted[0] == "train.py" and redacted[-4:] == ["--lr", "3e-4", "--tokenizer", "gpt2"]
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in redacted[9] and redacted[9].startswith("https://bucket.s3")
    assert json.loads(redacted[17]) == {"hf_token": "<redacted>", "lr": 3}  # JSON stays JSON
    assert not any(names_secret(k) for k in ("tokenizer", "max_tokens", "token_file", "monkey", "lr", "keys"))


@pytest.fixture(scope="module")
def planted_dump(tmp_path_factory):
    """A real Guard crash dump of a tiny GPT-2 (built-in recipe: replays without --trust), its job run with every
    planted form on its command line."""
    import torch
    import transformers

    from forensics.capture import Guard, GuardConfig
    from forensics.capture.dumping import environment
    from forensics.core.errors import TrainingFaultError

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    root = tmp_path_factory.mktemp("secrets")
    argv, sys.argv = sys.argv, list(PLANTED_ARGV)
    environment._static_environment.cache_clear()
    try:
        guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(root / "dumps"), run_id="secrets"))
        ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
        with pytest.raises(TrainingFaultError) as err:
            for step in range(3):
                embeds = model.transformer.wte(ids).detach()
                if step == 2:
                    embeds[1, 0, 0] = float("inf")
                batch = {"inputs_embeds": embeds, "labels": ids, "sample_ids": [f"s{step}-0", f"s{step}-1"]}
                guard.record_batch(batch)
                loss = model(inputs_embeds=batch["inputs_embeds"], labels=ids).loss
                guard.record_loss(loss)
                loss.backward()
                if guard.check():
                    optimizer.step()
                optimizer.zero_grad()
        guard.close()
    finally:
        sys.argv = argv
        environment._static_environment.cache_clear()
    return Path(err.value.dump_path)


def _archive_bytes(archive: Path) -> dict[str, bytes]:
    """Every member of a pack, decompressed (the compressed bytes would hide a secret from a plain search)."""
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(archive.read_bytes())).read()
    members = {"<tar stream>": raw}
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        for member in tar.getmembers():
            if member.isfile():
                members[member.name] = tar.extractfile(member).read()
    return members


def _pack_inspect_replay(dump: Path, out: Path) -> dict[str, bytes | str]:
    """What a user sees of the dump: its files, its pack, `inspect` (text and JSON), the replay's report files and
    output, and `inspect` / replay of the pack."""
    seen: dict[str, bytes | str] = {f"dump/{k}": v for k, v in every_file(dump).items()}
    runner = CliRunner()
    packed = runner.invoke(main, ["pack", str(dump), "-o", str(out / "dump.tar.zst")])
    assert packed.exit_code == 0, (packed.output, packed.exception)
    seen.update({f"pack/{k}": v for k, v in _archive_bytes(out / "dump.tar.zst").items()})
    for source in (str(dump), str(out / "dump.tar.zst")):
        for extra in ([], ["--json"]):
            shown = runner.invoke(main, ["inspect", source, *extra])
            assert shown.exit_code == 0, (shown.output, shown.exception)
            seen[f"inspect {source} {extra}"] = shown.output
    for n, source in enumerate((str(dump), str(out / "dump.tar.zst"))):
        report = out / f"report{n}"
        replayed = runner.invoke(main, ["replay", source, "--device", "cpu", "--no-remedies", "-o", str(report)])
        assert replayed.exit_code in (0, 3, 4), (replayed.output, replayed.exception)
        seen[f"replay {source} output"] = replayed.output
        seen.update({f"report{n}/{k}": v for k, v in every_file(report).items()})
        assert (report / "report.json").is_file()
    return seen


def test_no_planted_secret_reaches_the_dump_the_pack_inspect_or_the_report(planted_dump, tmp_path):
    argv = json.loads((planted_dump / "manifest.json").read_text())["environment"]["argv"]
    assert argv[:3] == ["train.py", "hub.token=<redacted>", "+trainer.hf_token=<redacted>"]
    seen = _pack_inspect_replay(planted_dump, tmp_path)
    found = {where: leaks(data) for where, data in seen.items() if leaks(data)}
    assert found == {}
    report = json.loads(seen["report0/report.json"])
    assert report["environment"]["capture"]["argv"][-2:] == ["--tokenizer", "gpt2"]  # the rest is shown


def test_a_dump_written_with_the_secrets_in_its_manifest_shows_none(planted_dump, tmp_path):
    """An older forensics redacted only `--hf-token X`-like flags: its dumps hold the other forms verbatim. Every
    reader (inspect, replay) and `pack` takes them out."""
    old = tmp_path / "old"
    import shutil

    shutil.copytree(planted_dump, old)
    edit_manifest(old, lambda m: m["environment"].update(argv=list(PLANTED_ARGV)))
    assert sorted(leaks((old / "manifest.json").read_bytes())) == sorted(SECRETS)  # planted as an old writer left it
    seen = _pack_inspect_replay(old, tmp_path)
    found = {where: leaks(data) for where, data in seen.items() if leaks(data) and not where.startswith("dump/")}
    assert found == {}
