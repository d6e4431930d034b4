"""The `forensics` command line: inspect, verify, pack, list, timeline, replay, demo. Each command parses, calls one
library function and maps the outcome to an exit code (forensics.core.kinds.ExitCode, the one table: a
replay exits with its verdict kind's code; bad input, code or environment is 2; 1 only for bugs; Ctrl-C is 130, with one
line, whatever the command was doing: the files it writes are each written whole or not at all)."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping

import click

from forensics.demo import SCENARIO_NAMES
from forensics.commands.catalog import REPORTS_DIR, report_dir_name
from forensics.core.errors import ForensicsError, StorageError
from forensics.format.location import Location, RemotePath
from forensics.format.limits import ArchiveLimits
from forensics.format.manifest import safe_name
from forensics.core.kinds import ExitCode, Tracker, VerdictKind
from forensics.report.tree import Report, parse_report
from forensics.report.wording import clean


def replay_exit_code(report: Mapping | Report) -> int:
    """The exit code of a replay: its verdict kind's (forensics.core.kinds.VerdictKind.exit_code)."""
    kind = parse_report(report).verdict.kind
    try:
        return int(VerdictKind(kind).exit_code)
    except ValueError:
        raise ForensicsError(f"the report has an unknown verdict kind {kind!r}") from None


class BadInput(click.ClickException):
    """The user's input, code or environment is at fault: shown as 'Error: ...' with exit code 2."""

    exit_code = int(ExitCode.BAD_INPUT)


def _fail(exc: Exception) -> BadInput:
    user_traceback = getattr(exc, "user_traceback", None)
    if user_traceback:  # forensics.core.errors.UserCodeError: their traceback, as they would see it themselves
        click.echo(user_traceback, err=True)
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return BadInput(clean(f"{exc.strerror or exc}{where}; choose a writable path"))
    return BadInput(clean(str(exc)))


def archive_options(command):
    """--max-unpacked-gb / --max-unpack-ratio / --max-members: the limits for unpacking a .tar.zst DUMP."""
    defaults = ArchiveLimits()
    command = click.option(
        "--max-members",
        type=click.IntRange(1),
        default=defaults.max_members,
        show_default=True,
        help="Archive DUMP: most files it may hold.",
    )(command)
    command = click.option(
        "--max-unpack-ratio",
        type=click.FloatRange(min=1.0, max=1e9),
        default=defaults.max_ratio,
        show_default=True,
        callback=_finite,
        help="Archive DUMP: most unpacked bytes per packed byte (beyond the first GiB).",
    )(command)
    return click.option(
        "--max-unpacked-gb",
        type=click.FloatRange(min=0.001, max=float(1 << 30)),
        default=defaults.max_bytes / (1 << 30),
        show_default=True,
        callback=_finite,
        help="Archive DUMP: most bytes it may unpack to.",
    )(command)


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A limit given as a float: a number (click's FloatRange lets NaN through)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number")
    return value


class LocationType(click.ParamType):
    """A dump, or a directory of dumps: a local path or an fsspec URL (s3://bucket/run/step-000000042)."""

    name = "PATH|URL"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> Location:
        from forensics.format.location import as_location

        try:
            return as_location(value if isinstance(value, (str, Path, RemotePath)) else str(value))
        except StorageError as exc:
            self.fail(clean(str(exc)), param, ctx)


LOCATION = LocationType()


def shards_option(command):
    """--shards DIR: other nodes' directories holding rank dumps of a sharded dump's step."""
    return click.option(
        "--shards",
        "shard_dirs",
        multiple=True,
        type=LOCATION,
        help="Sharded dump written on several nodes: another node's dump_dir (or run / step "
        "directory) holding the other ranks' dumps of this step. Repeatable.",
    )(command)


def _json_object(ctx: click.Context, param: click.Parameter, value: str | None) -> dict | None:
    """--factory-kwargs / --loss-kwargs: a JSON object, or None (keep the recorded ones)."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"is not JSON ({exc}); pass an object, e.g. '{{\"width\": 512}}'") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object of keyword arguments, e.g. '{\"width\": 512}'")
    return parsed


def recipe_options(command):
    """--trust / --factory / --loss / --path / --factory-kwargs / --loss-kwargs: what replay may import to rebuild
    the model and loss, and with what arguments."""
    command = click.option(
        "--path",
        "sys_path",
        multiple=True,
        type=click.Path(path_type=Path),
        help="Directory to put in front of sys.path for --factory / --loss (repeatable). The "
        "job's own directories, recorded in the dump, are used only with --trust.",
    )(command)
    command = click.option(
        "--loss-kwargs",
        default=None,
        metavar="JSON",
        callback=_json_object,
        help="Keyword arguments for the loss, instead of the recorded ones (kept otherwise, also "
        "with --loss, unless they are a built-in recipe's).",
    )(command)
    command = click.option(
        "--factory-kwargs",
        default=None,
        metavar="JSON",
        callback=_json_object,
        help="Keyword arguments for the model factory, instead of the recorded ones (kept "
        "otherwise, also with --factory, unless they are a built-in recipe's).",
    )(command)
    command = click.option(
        "--loss", "loss_fn", default=None, metavar="MODULE:FN", help="Loss function (model, batch) -> loss."
    )(command)
    command = click.option(
        "--factory", default=None, metavar="MODULE:FN", help="Model factory to use instead of the dump's."
    )(command)
    return click.option(
        "--trust",
        is_flag=True,
        help="Run code the dump names: import the model factory, loss, "
        "optimizer class and data recipe it names, or define them from the training script it holds "
        "(the script's imports, decorators, default values and class bodies run). Modules they "
        "import that are neither in the standard library nor installed are then also looked up, "
        "last, in the job's script and working directories recorded in the dump (`forensics "
        "inspect` shows them). Without it, only forensics' own recipes and the code you name with "
        "--factory / --loss run.",
    )(command)


def _limits(max_unpacked_gb: float, max_unpack_ratio: float, max_members: int) -> ArchiveLimits:
    return ArchiveLimits(
        max_bytes=int(max_unpacked_gb * (1 << 30)), max_ratio=max_unpack_ratio, max_members=max_members
    )


def _refuse_writing_into(dump: Location, outputs: dict[str, Path]) -> None:
    """A report or blocklist inside a rank dump (links resolved) would change it: it would then fail `verify`. A step
    directory's own level (beside its rank directories) is where reports go by default (forensics.commands.catalog)."""
    from forensics.format import spec

    if isinstance(dump, RemotePath):  # outputs are local paths: none can be inside a dump in object storage
        return
    root = (dump.parent if dump.name == spec.MANIFEST else dump).resolve()
    ranks = (
        [root]
        if (root / spec.MANIFEST).is_file() or not root.is_dir()
        else [p.resolve() for p in root.iterdir() if p.name.startswith("rank-")]
    )
    for option, output in outputs.items():
        target = output.resolve()
        if target == root and root not in ranks:
            raise BadInput(
                clean(
                    f"{option} {output} is the dump's step directory itself; choose a directory of "
                    f"its own (the default is report-rank<R> inside it)"
                )
            )
        if any(target == rank or rank in target.parents for rank in ranks):
            raise BadInput(
                clean(
                    f"the report would be written into the dump ({option} {output} is inside {dump}); "
                    f"choose another {option}"
                )
            )


def _refuse_unwritable(outputs: dict[str, Path]) -> None:
    """An output that cannot be written is an error now, before the dump is opened or the model built: `-o` a
    directory (made if missing), `--blocklist` a file. Nothing is left behind by the probe."""
    for option, output in outputs.items():
        directory = output.parent if option == "--blocklist" else output
        if option == "--blocklist" and output.is_dir():
            raise BadInput(clean(f"--blocklist {output} is a directory; name a file"))
        existing = directory
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        try:
            if not existing.is_dir():
                raise NotADirectoryError(20, "Not a directory", str(existing))
            if existing == directory:
                tempfile.TemporaryFile(dir=directory).close()
            else:
                first = directory
                while first.parent != existing:
                    first = first.parent
                first.mkdir()
                first.rmdir()
        except OSError as exc:
            where = exc.filename or existing
            raise BadInput(
                clean(f"{option} {output} cannot be written ({exc.strerror or exc}: {where}); choose a writable path")
            ) from None


def _report_dir(report: Report) -> Path:
    """forensics_reports/<run>-step<N>-rank<R>-<where>: one folder per dump (catalog.report_dir_name)."""
    d = report.dump
    return Path(REPORTS_DIR) / report_dir_name(d.run_id, d.step, int(d.rank or 0), d.path or "")


class Interruptible(click.Group):
    """The command group: Ctrl-C ends any command with exit code 130 (ExitCode.INTERRUPTED) and the one line
    "interrupted", never click's "Aborted!" (exit 1, the code of a bug) nor a traceback. An interrupt that library
    code swallowed (a KeyboardInterrupt raised inside a finalizer or weakref callback is only printed by Python) is
    still obeyed: the next progress line raises it again, and a command that ends anyway exits 130."""

    interrupted = False

    def invoke(self, ctx: click.Context):
        Interruptible.interrupted = False

        def on_sigint(signum, frame):
            Interruptible.interrupted = True
            raise KeyboardInterrupt

        try:
            previous = signal.signal(signal.SIGINT, on_sigint)
        except ValueError:  # not the main thread (an embedding application): its own handler stays
            previous = None
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            Interruptible.interrupted = True
        except BaseException:
            if not Interruptible.interrupted:
                raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if Interruptible.interrupted:
                click.echo("interrupted", err=True)
        raise click.exceptions.Exit(int(ExitCode.INTERRUPTED))

    @staticmethod
    def check() -> None:
        """Raises KeyboardInterrupt again when an interrupt was swallowed since the command started."""
        if Interruptible.interrupted:
            raise KeyboardInterrupt


@click.group(cls=Interruptible, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="forensics", prog_name="forensics")
@click.option(
    "--storage-timeout",
    type=click.FloatRange(min=0.1, max=3600),
    default=None,
    help="A dump at a URL: seconds each request to the store may wait to connect, and again for its reply "
    "[default: $FORENSICS_STORAGE_TIMEOUT or 20].",
)
@click.option(
    "--storage-retries",
    type=click.IntRange(0, 20),
    default=None,
    help="A dump at a URL: attempts after the first for a request that timed out [default: "
    "$FORENSICS_STORAGE_RETRIES or 2]. A hung store fails the command (exit 2) after about "
    "2 x timeout x (retries + 1) seconds.",
)
def main(storage_timeout: float | None, storage_retries: int | None) -> None:
    """Crash forensics for PyTorch training: inspect, verify and replay dumps of failing steps."""
    _bound_storage_requests(storage_timeout, storage_retries)


def _bound_storage_requests(seconds: float | None, retries: int | None) -> None:
    """The commands' timeouts for dumps at URLs, and a line on stderr for each request still waiting after a few
    seconds (a hung store is said, not silent)."""
    from forensics.format.location import StorageTimeouts, set_storage_timeouts, slow_requests

    try:
        default = StorageTimeouts.from_environment()
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    timeouts = StorageTimeouts(
        default.seconds if seconds is None else seconds, default.retries if retries is None else retries
    )
    set_storage_timeouts(timeouts)

    def still_waiting(what: str, where: str, waited: float) -> None:
        click.echo(
            clean(
                f"forensics: {what} {where}: no answer for {waited:.0f} s (each request gives up after "
                f"{timeouts.worst_case_s:.0f} s at most: --storage-timeout, --storage-retries)"
            ),
            err=True,
        )

    slow_requests.watch(still_waiting)


@main.command()
@click.argument("dump", type=LOCATION)
@click.option("--rank", type=int, default=None, help="Rank to show, for a step directory of several ranks.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@archive_options
def inspect(dump: Location, rank: int | None, as_json: bool, **limits) -> None:
    """Summarise a dump: trigger, step, rank, samples, history, sizes, environment. Reads no weights."""
    from forensics.format import open_dump, open_step
    from forensics.commands.summary import dump_summary, render_damage, render_summary

    try:
        chosen = open_dump(dump, rank=rank, limits=_limits(**limits))
        _, missing = open_step(dump) if dump.is_dir() else ([], [])
        summary = dump_summary(chosen, missing, path=str(dump) if dump.is_file() else None)
    except ForensicsError as exc:
        raise _fail(exc) from exc
    if as_json:
        from forensics.format.jsonio import to_jsonable

        click.echo(json.dumps(to_jsonable(summary.as_dict()), indent=2))
    else:
        click.echo(render_summary(summary))
    damaged = summary.damaged or []
    if damaged:  # the summary is shown, but the dump is not whole
        for line in render_damage(summary):
            click.echo(line, err=True)
        more = f" (and {len(damaged) - 1} more problem(s))" if len(damaged) > 1 else ""
        raise BadInput(clean(f"{dump} is damaged: {damaged[0]}{more}; `forensics verify` checks it whole"))


@main.command()
@click.argument("dump", type=LOCATION)
@archive_options
@shards_option
def verify(dump: Location, shard_dirs: tuple[Location, ...], **limits) -> None:
    """Check a dump's integrity (every file's size and sha256, all ranks present; a sharded dump: every part of
    the state present); names the bad file and the missing tensors."""
    from forensics.format import verify_dump

    try:
        result = verify_dump(dump, limits=_limits(**limits), shard_dirs=list(shard_dirs))
    except ForensicsError as exc:
        raise _fail(exc) from exc
    for d in result.dumps:
        click.echo(f"rank {d.rank}: {len(d.manifest['files'])} files listed, step {d.step}")
    if result.ok:
        click.echo(f"OK: {dump} is intact")
        return
    for problem in result.problems:
        click.echo(clean(f"PROBLEM {problem}"), err=True)
    if result.only_ranks_missing:
        present = sorted(d.rank for d in result.dumps)
        raise BadInput(
            f"{dump} lacks the dumps of rank(s) {result.missing_ranks} (their micro-batches are lost), but "
            f"its state is whole: replay rank(s) {present} (forensics replay {dump} --rank R)"
        )
    raise BadInput(f"{dump} failed verification ({len(result.problems)} problem(s)); do not trust it for replay")


@main.command()
@click.argument("dump", type=LOCATION)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="Archive path (default: DUMP.tar.zst next to it; for a URL, ./<run>-step<N>[-rank<R>].tar.zst).",
)
@click.option("--force", is_flag=True, help="Replace the archive's path if a file is there already.")
def pack(dump: Location, output: Path | None, force: bool) -> None:
    """Pack a dump directory into one .tar.zst to attach to job artifacts (every command reads it)."""
    from forensics.format import pack_dump

    try:
        archive = pack_dump(dump, output, force=force)
    except (ForensicsError, OSError) as exc:
        raise _fail(exc) from exc
    click.echo(str(archive))


@main.command(name="list")
@click.argument("directory", type=LOCATION, default="forensics_dumps")
@click.option("--verify", "check", is_flag=True, help="Also check every file's size and sha256 (reads everything).")
@click.option(
    "--reports",
    type=click.Path(path_type=Path),
    default=Path(REPORTS_DIR),
    show_default=True,
    help="Where `forensics replay` wrote its reports (to tell which dumps were replayed).",
)
@click.option("--clean-stale", is_flag=True, help="Remove the unfinished .tmp-* dumps of writers that are gone.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def list_command(directory: Location, check: bool, reports: Path, clean_stale: bool, as_json: bool) -> None:
    """List every dump under DIRECTORY (default ./forensics_dumps): run, step, trigger, ranks, size, verified,
    replayed; and unfinished dumps left by killed writers."""
    from forensics.commands.catalog import list_dumps
    from forensics.format.stale import remove_stale_temporaries
    from forensics.report.wording import fmt_size

    if not isinstance(directory, RemotePath) and not directory.is_dir():
        raise BadInput(clean(f"{directory} is not a directory: pass the Guard's dump_dir (or a URL, s3://...)"))
    try:
        rows, stale = list_dumps(directory, verify=check, reports=reports)
    except (ForensicsError, OSError) as exc:
        raise _fail(exc) from exc
    if clean_stale and not isinstance(directory, RemotePath):
        removed = remove_stale_temporaries(directory)
        stale = [p for p in stale if p not in removed]
        for path in removed:
            click.echo(clean(f"removed unfinished dump {path}"), err=True)
    if as_json:
        click.echo(json.dumps({"dumps": [r.as_dict() for r in rows], "stale": [str(p) for p in stale]}, indent=2))
        return
    if not rows and not stale:
        click.echo(clean(f"no dumps under {directory}"))
        return
    header = f"{'run':<28} {'step':>9}  {'trigger':<16} {'ranks':<9} {'size':>9}  {'verified':<8} {'replayed':<8} path"
    click.echo(header)
    for r in rows:
        if r.error:
            click.echo(clean(f"{r.path}: unreadable: {r.error}"))
            continue
        ranks = f"{len(r.ranks)}/{r.world_size}"
        verified = "-" if r.verified is None else "yes" if r.verified else "NO"
        click.echo(
            clean(
                f"{(r.run_id or '?')[:28]:<28} {r.step:>9}  {r.trigger or '?':<16} {ranks:<9} "
                f"{fmt_size(r.bytes):>9}  {verified:<8} {'yes' if r.report else 'no':<8} {r.path}"
            )
        )
        if r.report:
            click.echo(clean(f"    report: {r.report}"))
    for path in stale:
        click.echo(clean(f"unfinished (writer gone): {path}  — `forensics list --clean-stale` removes it"))


@main.command()
@click.argument("run", type=LOCATION, default="forensics_dumps")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the run page (HTML) here (default: <dump_dir>/runlogs/<run>/run.html for a local run).",
)
@click.option("--run", "run_id", default=None, help="Which run, when RUN is a dump directory holding several.")
@click.option(
    "--reports",
    type=click.Path(path_type=Path),
    default=Path(REPORTS_DIR),
    show_default=True,
    help="Where `forensics replay` wrote reports it could not put beside the dump.",
)
def timeline(run: Location, output: Path | None, run_id: str | None, reports: Path) -> None:
    """A run at a glance: the loss, gradient norm, learning rate and loss scale of every rank over the steps, each
    trigger (dumped or not, the rank that saw it first), each dump and its replay's verdict. Prints a summary and
    writes one self-contained HTML page (opens offline): to -o, else beside the run log
    (<dump_dir>/runlogs/<run>/run.html, where each replay report links to it; a URL's: -o only). RUN: the Guard's
    dump_dir or one run directory in it (a path or a URL)."""
    from forensics.commands.timeline import build_timeline, default_page, summary_text
    from forensics.core.fsio import atomic_write_text
    from forensics.report.timeline_html import render_timeline_html

    try:
        built = build_timeline(run, run_id, reports)
        click.echo(summary_text(built))
        if output is None:
            output = default_page(built)
        if output is not None:
            atomic_write_text(output, render_timeline_html(built, output))
            click.echo(clean(f"run page written to {output}"))
    except (ForensicsError, OSError) as exc:
        raise _fail(exc) from exc


def _upload_report(tracker: str, report: Report, files: dict, tensorboard_dir: Path | None) -> str:
    from forensics.core.uploads import upload

    d, verdict = report.dump, report.verdict
    run = d.run_id if safe_name(d.run_id) else "run"
    summary = {
        "run_id": run,
        "step": d.step,
        "rank": d.rank,
        "verdict": verdict.kind,
        "headline": verdict.headline,
        "exit_code": replay_exit_code(report),
    }
    return upload(
        tracker,
        [Path(p) for p in files.values()],
        f"{run}-step{d.step}-rank{d.rank}-report",
        "report",
        summary,
        tensorboard_dir,
    )


def _size(ctx: click.Context, param: click.Parameter, text: str | None) -> int | None:
    """--memory-budget's SIZE in bytes (None: not given)."""
    from forensics.core.sizes import parse_bytes

    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--memory-budget") from None


def _progress(stage: str) -> None:
    Interruptible.check()
    click.echo(f"[{time.strftime('%H:%M:%S')}] {stage}", err=True)


@main.command()
@click.argument("dump", type=LOCATION)
@click.option("--device", default=None, help="cuda:0, cpu, ... (default: CUDA when present).")
@click.option("--rank", type=int, default=None, help="Which rank of a multi-rank step dump to replay.")
@click.option("--all-ranks", is_flag=True, help="Replay every rank present, one after another.")
@recipe_options
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Report directory (default: report-rank<R> in the dump's step directory, beside the rank "
    "directories; ./forensics_reports/<run>-step<N>-rank<R>-<where> for an archive or a URL).",
)
@click.option(
    "--blocklist",
    type=click.Path(path_type=Path),
    default=None,
    help="Where to write the culprit sample IDs, one JSON value per line (default: blocklist.jsonl "
    "next to the report, whenever the verdict names culprit samples).",
)
@click.option(
    "--from",
    "from_checkpoint",
    type=click.Path(path_type=Path),
    default=None,
    help="Window replay: an earlier checkpoint (forensics dump, HF/Accelerate checkpoint directory, "
    ".safetensors, or a weights-only torch.save file); re-executes the recorded steps from it to find "
    "the step that broke the weights. Needs the dump's data recipe (--trust).",
)
@click.option(
    "--from-step",
    type=click.IntRange(min=0),
    default=None,
    help="With --from: the step the checkpoint was taken before (default: what it says).",
)
@click.option(
    "--no-window",
    is_flag=True,
    help="A dump holding the Guard's host snapshot (snapshot_every): analyse "
    "the dumped step only, without re-executing the recorded steps from the snapshot.",
)
@click.option("--no-bisect", is_flag=True, help="Skip the sample bisection.")
@click.option(
    "--no-remedies",
    is_flag=True,
    help="Skip trying fixes on the step (drop samples, eps, fp32, loss scale, clip, lower LR, skip).",
)
@click.option(
    "--no-rng-check",
    is_flag=True,
    help="Skip the re-runs with other seeds that tell whether the "
    "failure needs the recorded random state (e.g. one dropout mask).",
)
@click.option(
    "--memory-budget",
    "--gpu-memory",
    "memory_budget",
    default=None,
    metavar="SIZE",
    callback=_size,
    help="Memory the replay may use on its device (the CPU too), e.g. 16GiB: a state that does not fit is "
    "streamed block by block from the dump (automatic on a GPU it does not fit). --gpu-memory is the "
    "same option under its earlier name.",
)
@click.option("--json", "as_json", is_flag=True, help="Print report.json to stdout.")
@click.option(
    "--upload",
    "trackers",
    multiple=True,
    type=click.Choice(Tracker.values()),
    help="Also send the report to this tracker's run (WANDB_RUN_ID / MLFLOW_RUN_ID name it; repeatable).",
)
@click.option(
    "--tensorboard-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="TensorBoard log directory for --upload tensorboard.",
)
@archive_options
@shards_option
def replay(
    dump: Path,
    device,
    rank,
    all_ranks,
    trust,
    factory,
    loss_fn,
    sys_path,
    factory_kwargs,
    loss_kwargs,
    out,
    blocklist,
    from_checkpoint,
    from_step,
    no_window,
    no_bisect,
    no_remedies,
    no_rng_check,
    memory_budget,
    as_json,
    trackers,
    tensorboard_dir,
    shard_dirs,
    **limits,
) -> None:
    """Replay the failing step of DUMP offline, localise it, bisect the samples, print the verdict."""
    from forensics.core.gc_pause import gc_paused

    outputs = {"-o": out or Path("forensics_reports"), **({"--blocklist": blocklist} if blocklist else {})}
    _refuse_writing_into(dump, outputs)
    _refuse_unwritable({**({"-o": out} if out else {}), **({"--blocklist": blocklist} if blocklist else {})})
    if isinstance(dump, RemotePath) and not all_ranks:  # its files fetched while torch and the model's code import
        from forensics.format.reader import start_fetching

        with contextlib.suppress(ValueError):  # bad limits: said below
            start_fetching(dump, rank, _limits(**limits), [str(d) for d in shard_dirs])
        from forensics.format.prefetch import release

        click.get_current_context().call_on_close(release)  # an error or Ctrl-C before the replay claimed it

    with gc_paused():  # torch imports here: forensics.core.gc_pause
        from forensics.format import open_step
        from forensics.commands.catalog import default_report_dir, note_report
        from forensics.report import render_verdict_text, write_blocklist, write_report_files
        from forensics.report.write import BLOCKLIST_NAME, blocklist_ids
        from forensics.replay.engine import ReplayOptions, replay_report

    try:
        archive_limits = _limits(**limits)
        ranks = [d.rank for d in open_step(dump, archive_limits)[0]] if all_ranks else [rank]
        codes = []
        for chosen_rank in ranks:
            options = ReplayOptions(
                device=device,
                trust=trust,
                factory=factory,
                loss=loss_fn,
                sys_path=[str(p) for p in sys_path],
                factory_kwargs=factory_kwargs,
                loss_kwargs=loss_kwargs,
                rank=chosen_rank,
                bisect=not no_bisect,
                rng_check=not no_rng_check,
                remedies=not no_remedies,
                from_checkpoint=str(from_checkpoint) if from_checkpoint else None,
                from_step=from_step,
                window=not no_window,
                archive_limits=archive_limits,
                memory_budget=memory_budget,
                shard_dirs=[str(d) for d in shard_dirs],
            )
            report = replay_report(dump, options, progress=_progress)
            rank = report.dump.rank or 0  # a replayed dump names its rank
            target = out or default_report_dir(report.dump.path, rank) or _report_dir(report)
            if all_ranks and out:
                target = out / f"rank{rank}"
            files = write_report_files(report, target)
            note_report(report.dump.path, rank, files["json"])
            culprits = blocklist_ids(report)  # never IDs made up from positions
            if blocklist or culprits:  # the verdict's "blocklist.jsonl lists the culprits" is always true
                files["blocklist"] = write_blocklist(
                    report, blocklist or target / BLOCKLIST_NAME, append=bool(blocklist) and chosen_rank != ranks[0]
                )
            for tracker in trackers:
                click.echo(f"uploaded: {_upload_report(tracker, report, files, tensorboard_dir)}", err=True)
            if as_json:
                click.echo(Path(files["json"]).read_text())
            else:
                click.echo(render_verdict_text(report, files=files))
            codes.append(replay_exit_code(report))
    except (ForensicsError, OSError) as exc:  # the dump, the recipe, the device, an unwritable -o / --blocklist
        raise _fail(exc) from exc
    sys.exit(min(codes) if codes else int(ExitCode.NO_CULPRIT))


@main.command()
@click.argument("dump", type=LOCATION)
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Directory for the scripts.")
@click.option("--device", default="cpu", show_default=True, help="cuda:0, cpu, ...: where the step is re-run.")
@click.option("--rank", type=int, default=None, help="Which rank of a multi-rank step dump.")
@recipe_options
@click.option(
    "--report",
    "report_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="A report directory of this dump (forensics replay -o): its report links the scripts.",
)
def repro(
    dump: Path, out: Path, device, rank, trust, factory, loss_fn, sys_path, factory_kwargs, loss_kwargs, report_dir
) -> None:
    """Write a standalone reproduction of DUMP's failure into OUT: op_repro.py (the first non-finite op on its
    exact, shrunk inputs; needs only torch) and model_repro.py (the culprit sample through the dumped weights;
    needs the model code). Each fails with an AssertionError while the bug is there."""
    from forensics.replay.repro import link_report, write_repro

    _refuse_writing_into(dump, {"-o": out})
    _refuse_unwritable({"-o": out})
    try:
        result = write_repro(
            dump,
            out,
            device=device,
            trust=trust,
            factory=factory,
            loss=loss_fn,
            sys_path=[str(p) for p in sys_path],
            rank=rank,
            factory_kwargs=factory_kwargs,
            loss_kwargs=loss_kwargs,
        )
        if report_dir is not None:
            link_report(report_dir, result)
    except (ForensicsError, OSError) as exc:
        raise _fail(exc) from exc
    for key, path in result.files.items():
        click.echo(clean(f"{key}: {path}"))
    for note in result.notes:
        click.echo(clean(f"note: {note}"), err=True)


class _DemoCommand(click.Command):
    """`forensics demo --help` lists each scenario with its one-line description (loaded only for the help)."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help_text(ctx, formatter)
        from forensics.demo import SCENARIOS

        with formatter.section("Scenarios"):
            formatter.write_dl([(s.name, s.description) for s in SCENARIOS.values()])


@main.command(cls=_DemoCommand)
@click.option(
    "--scenario",
    type=click.Choice(SCENARIO_NAMES),
    default="bad_sample",
    show_default=True,
    help="The planted fault (each is described under Scenarios above).",
)
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=Path),
    default=Path(tempfile.gettempdir()) / "forensics_demo",
    show_default=True,
    help="Where the demo writes its dump and report (outside your repository).",
)
@click.option("--device", default=None, help="cuda:0, cpu, ... (default: CUDA when present).")
def demo(scenario: str, out: Path, device: str | None) -> None:
    """Train a small GPT-style model with a planted fault, capture it, replay it, print the verdict."""
    from forensics.demo.run import run_demo

    try:
        report, _ = run_demo(scenario, out, device, echo=click.echo)
    except (ForensicsError, OSError) as exc:
        raise _fail(exc) from exc
    sys.exit(replay_exit_code(report))


if __name__ == "__main__":  # pragma: no cover
    main()
