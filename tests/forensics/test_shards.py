"""The sharded layout (dump format version 2), in one process: what each rank writes, how a reader assembles it,
and what it says when part of the state is missing or a manifest lies about its shards."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner

from forensics.capture.state.buddy import buddy_offsets
from forensics.capture.state.sharding import Assignment, shard_state
from forensics.cli import main
from forensics.core.errors import DumpCorruptError, DumpIncompleteError
from forensics.format import open_dump, verify_dump, write_dump
from forensics.format.shards import LocalShard, ShardCopies, table_entry
from forensics_test_helpers import bitwise_equal, synthetic_content  # tests/helpers.py (tests/conftest.py)


COMPLETE = "; the state is complete without it (other ranks also wrote its part): replay another rank"


def _identity(tensor):
    return tensor


def _write_ranks(root, world: int, replicas: int = 1) -> tuple[list, dict]:
    """Every rank's part of synthetic_content's state under `root`, as shard_state splits replicated tensors."""
    paths, originals = [], None
    for rank in range(world):
        content, originals = synthetic_content(rank=rank, world_size=world)
        state, table = shard_state(
            {"model": content.model, "optimizer": content.optimizer}, rank, world, replicas, _identity
        )
        content.model, content.optimizer, content.layout = state["model"], state["optimizer"], table
        paths.append(write_dump(content, root))
    return paths, originals


def _assert_state_equals(dump, originals) -> None:
    weights = dump.model_state()
    assert sorted(weights) == sorted(originals["model"])
    for name, expected in originals["model"].items():
        assert bitwise_equal(weights[name], expected), name
    optimizer = dump.optimizer_state()
    assert optimizer["param_groups"] == originals["optimizer"]["param_groups"]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert bitwise_equal(optimizer["state"]["w"][key], originals["optimizer"]["state"]["w"][key]), key
    assert optimizer["state"]["half"] == {"step": 3, "note": "scalar state"}


def _shard_bytes(paths) -> int:
    total = 0
    for path in paths:
        manifest = json.loads((path / "manifest.json").read_text())
        for file, shards in manifest["layout"]["shards"].items():
            rows = manifest["layout"]["tensors"][file]
            total += sum(
                math.prod(s["shape"]) * torch.tensor([], dtype=getattr(torch, rows[n]["dtype"])).element_size()
                for n, s in shards.items()
            )
    return total


def _one_copy_bytes(originals) -> int:
    tensors = list(originals["model"].values()) + [
        v for e in originals["optimizer"]["state"].values() for v in e.values() if isinstance(v, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_ranks_split_replicated_state_once_and_any_rank_reads_it_whole(tmp_path):
    paths, originals = _write_ranks(tmp_path, world=3)
    assert _shard_bytes(paths) == _one_copy_bytes(originals)  # one copy across the ranks, no more
    for path in paths:
        assert json.loads((path / "manifest.json").read_text())["format_version"] == 2
        _assert_state_equals(open_dump(path), originals)
    result = verify_dump(paths[0].parent)
    assert result.ok, [str(p) for p in result.problems]


def test_a_missing_rank_names_the_tensors_it_held_in_verify_and_replay(tmp_path):
    paths, _ = _write_ranks(tmp_path, world=3)
    lost = json.loads((paths[2] / "manifest.json").read_text())["layout"]["shards"]
    lost_names = sorted(name for shards in lost.values() for name in shards)
    assert lost_names
    shutil.rmtree(paths[2])
    result = verify_dump(paths[0].parent)
    assert result.missing_ranks == [2]
    messages = [str(p) for p in result.problems]
    assert any("tensors have parts no rank dump holds" in m for m in messages), messages
    for name in lost_names:
        assert any(repr(name.removeprefix("state/")) in m or repr(name) in m for m in messages), name
    with pytest.raises(DumpIncompleteError) as caught:
        open_dump(paths[0]).model_state()
    assert caught.value.missing_ranks == [2]
    assert set(caught.value.missing_tensors) == set(lost_names)
    out = CliRunner().invoke(main, ["replay", str(paths[0].parent), "--device", "cpu"])
    assert out.exit_code == 2, out.output
    assert "sharded dump is incomplete" in out.output and "missing: [2]" in out.output


def test_with_two_replicas_a_lost_rank_loses_nothing(tmp_path):
    paths, originals = _write_ranks(tmp_path, world=3, replicas=2)
    assert _shard_bytes(paths) == 2 * _one_copy_bytes(originals)
    shutil.rmtree(paths[1])
    _assert_state_equals(open_dump(paths[0]), originals)
    result = verify_dump(paths[0].parent)
    assert [str(p) for p in result.problems] == [
        "rank-00001: rank dump is missing (that rank did not finish writing)" + COMPLETE
    ]


def test_ranks_on_two_nodes_are_joined_with_shard_dirs(tmp_path):
    paths, originals = _write_ranks(tmp_path / "node0", world=2)
    node1 = tmp_path / "node1" / paths[1].relative_to(tmp_path / "node0")
    node1.parent.mkdir(parents=True)
    shutil.move(str(paths[1]), str(node1))
    with pytest.raises(DumpIncompleteError):
        open_dump(paths[0]).model_state()
    _assert_state_equals(open_dump(paths[0], shard_dirs=[tmp_path / "node1"]), originals)
    assert open_dump(paths[0].parent, rank=1, shard_dirs=[tmp_path / "node1"]).path == node1
    out = CliRunner().invoke(main, ["verify", str(paths[0].parent), "--shards", str(tmp_path / "node1")])
    assert out.exit_code == 0, out.output


def _box_dumps(root, shards_per_rank, copies: bool = False):
    """Two ranks holding boxes of `full` (4, 6): rank r writes shards_per_rank[r] as LocalShards (and, with
    `copies`, the other rank's as its buddy copy, as DumpConfig(shard_replicas=2) does)."""
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)

    def shard(offsets, shape, flat):
        if flat:
            data = full.reshape(-1)[offsets[0] : offsets[0] + shape[0]].clone()
        else:  # a box past the tensor's edge (a lying writer) is padded with zeros to its claimed shape
            data = torch.zeros(shape)
            part = full[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]]
            data[: part.shape[0], : part.shape[1]] = part
        return LocalShard(data, (4, 6), offsets, flat)

    paths = []
    for rank, (box,) in enumerate(shards_per_rank):  # one box of "grid" per rank
        content, _ = synthetic_content(rank=rank, world_size=2)
        content.model, content.optimizer = {"grid": shard(*box)}, None
        content.layout = {
            "model.safetensors": {"grid": table_entry((4, 6), torch.float32)},
            "optimizer.safetensors": {},
        }
        if copies:
            content.copies = [
                ShardCopies(1 - rank, {"model.safetensors": {"grid": shard(*shards_per_rank[1 - rank][0])}})
            ]
        paths.append(write_dump(content, root))
    return paths, full


ROWS = [[((0, 0), (3, 6), False)], [((3, 0), (1, 6), False)]]


def test_a_buddy_copy_serves_where_its_owner_is_missing_and_only_there(tmp_path):
    paths, full = _box_dumps(tmp_path, ROWS, copies=True)
    manifest = json.loads((paths[1] / "manifest.json").read_text())
    assert manifest["layout"]["copies"] == {
        "copy-00000-model.safetensors": {
            "of": "model.safetensors",
            "rank": 0,
            "shards": {"grid": {"offsets": [0, 0], "shape": [3, 6], "flat": False}},
        }
    }
    assert verify_dump(paths[0].parent).ok  # copies are listed, hashed files like any other
    shown = CliRunner().invoke(main, ["inspect", str(paths[1])])
    assert "buddy copies: the parts of rank(s) 0 too" in shown.output, shown.output
    # both ranks present: each rank's own shard is read, so a damaged copy costs nothing (verify still says so)
    (paths[1] / "copy-00000-model.safetensors").write_bytes(b"\0" * 16)
    assert bitwise_equal(open_dump(paths[1]).model_state()["grid"], full)
    assert "copy-00000-model.safetensors" in " ".join(str(p) for p in verify_dump(paths[0].parent).problems)
    # rank 1's dump lost: rank 0's copy of it completes the state
    shutil.rmtree(paths[1])
    assert bitwise_equal(open_dump(paths[0]).model_state()["grid"], full)
    assert [str(p) for p in verify_dump(paths[0].parent).problems] == [
        "rank-00001: rank dump is missing (that rank did not finish writing)" + COMPLETE
    ]
    verified = CliRunner().invoke(main, ["verify", str(paths[0].parent)])
    assert verified.exit_code == 2 and "but its state is whole: replay rank(s) [0]" in verified.output


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: c.update(of="rng.safetensors"), "layout.copies"),
        (lambda c: c.update(rank=-1), "rank"),
        (lambda c: c["shards"]["grid"].update(shape=[4000, 6]), "do not fit"),
        (lambda c: c["shards"].update(ghost={"offsets": [0], "shape": [1], "flat": True}), "not in layout.tensors"),
        (lambda c: c["shards"]["grid"].update(offsets=[1, 0]), "overlapping"),
    ],
)
def test_a_lying_copy_is_refused_before_anything_is_allocated(tmp_path, edit, words):
    paths, _ = _box_dumps(tmp_path, ROWS, copies=True)
    shutil.rmtree(paths[0])
    _edit_manifest(paths[1], lambda m: edit(m["layout"]["copies"]["copy-00000-model.safetensors"]))
    with pytest.raises(DumpCorruptError, match=words):
        open_dump(paths[1]).model_state()


@pytest.mark.parametrize("stored", ["../rank-00000/model.safetensors", "model.safetensors"])
def test_a_copy_outside_the_dump_or_in_its_own_state_file_is_refused(tmp_path, stored):
    paths, _ = _box_dumps(tmp_path, ROWS, copies=True)
    _edit_manifest(
        paths[1], lambda m: m["layout"].update(copies={stored: m["layout"]["copies"]["copy-00000-model.safetensors"]})
    )
    with pytest.raises(DumpCorruptError, match="not a plain file name"):
        open_dump(paths[1]).model_state()


@pytest.mark.parametrize(
    "world, per_node, count, expected",
    [
        (8, 4, 1, [4]),  # two nodes: the buddy is on the other node
        (16, 4, 2, [4, 8]),  # copies on two other nodes
        (4, 4, 1, [1]),  # one node: the next rank
        (4, 2, 3, [2, 1, 3]),  # more copies than nodes: other nodes first, then neighbours; never itself
        (3, 3, 5, [1, 2]),  # never more buddies than other ranks
    ],
)
def test_buddies_sit_on_other_nodes_first(world, per_node, count, expected):
    assert buddy_offsets(world, per_node, count) == expected


@pytest.mark.parametrize(
    "boxes",
    [
        [[((0, 0), (4, 4), False)], [((0, 4), (4, 2), False)]],  # column shards (tensor parallel, Shard(1))
        [[((0, 0), (3, 6), False)], [((3, 0), (1, 6), False)]],  # uneven row shards (FSDP2's Shard(0))
        [[((0,), (10,), True)], [((10,), (14,), True)]],  # flat partitions (ZeRO)
    ],
)
def test_boxes_of_a_tensor_are_assembled_in_place(tmp_path, boxes):
    paths, full = _box_dumps(tmp_path, boxes)
    assert bitwise_equal(open_dump(paths[0]).model_state()["grid"], full)


@pytest.mark.parametrize(
    "boxes, words",
    [
        ([[((0, 0), (3, 6), False)], [((2, 0), (2, 6), False)]], "overlapping"),
        ([[((0, 0), (4, 4), False)], [((0, 4), (4, 4), False)]], "outside"),
    ],
)
def test_shards_that_overlap_or_overflow_are_refused(tmp_path, boxes, words):
    paths, _ = _box_dumps(tmp_path, boxes)
    with pytest.raises(DumpCorruptError, match=words):
        open_dump(paths[0]).model_state()
    assert not verify_dump(paths[0].parent).ok


def _edit_manifest(path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m.update(format_version=1), "needs format_version 2 or later"),
        (
            lambda m: m["layout"]["tensors"]["model.safetensors"].update(
                grid={"shape": [1 << 40, 1 << 40], "dtype": "float32"}
            ),
            "different state",
        ),
        (lambda m: m["layout"]["shards"]["model.safetensors"]["grid"].update(shape=[4000, 6]), "do not fit"),
        (lambda m: m["layout"].update(kind="striped"), "layout.kind"),
        (lambda m: m["layout"]["tensors"].update({"../../etc/passwd": {}}), "only"),
        (lambda m: m.update(run_id="another-run"), "not a shard of the same dump"),
    ],
)
def test_a_lying_layout_is_refused_before_anything_is_allocated(tmp_path, edit, words):
    paths, _ = _box_dumps(tmp_path, [[((0, 0), (2, 6), False)], [((2, 0), (2, 6), False)]])
    _edit_manifest(paths[0], edit)
    with pytest.raises(DumpCorruptError, match=words):
        open_dump(paths[0]).model_state()


def test_a_huge_declared_tensor_without_data_is_missing_not_allocated(tmp_path):
    paths, _ = _box_dumps(tmp_path, [[((0, 0), (2, 6), False)], [((2, 0), (2, 6), False)]])
    for path in paths:
        _edit_manifest(
            path,
            lambda m: m["layout"]["tensors"]["model.safetensors"].update(
                huge={"shape": [1 << 40, 1 << 40], "dtype": "float32"}
            ),
        )
    with pytest.raises(DumpIncompleteError, match="'huge'"):
        open_dump(paths[0]).model_state()


def test_replicated_tensors_are_spread_by_bytes_and_every_rank_agrees():
    sizes = {f"t{i}": (i + 1) * 100 for i in range(40)}
    first = Assignment(sizes, world_size=4, replicas=1).writers
    assert first == Assignment(dict(reversed(list(sizes.items()))), world_size=4, replicas=1).writers
    loads = [sum(sizes[n] for n, ranks in first.items() if rank in ranks) for rank in range(4)]
    assert max(loads) <= 1.05 * sum(sizes.values()) / 4
    twice = Assignment(sizes, world_size=4, replicas=2).writers
    assert all(len(set(ranks)) == 2 for ranks in twice.values())
    across = Assignment(sizes, world_size=4, replicas=2, per_node=2).writers  # two nodes of two ranks
    assert all(len({rank // 2 for rank in ranks}) == 2 for ranks in across.values())  # never both on one node
    loads = [sum(sizes[n] for n, ranks in across.items() if rank in ranks) for rank in range(4)]
    assert max(loads) <= 1.05 * 2 * sum(sizes.values()) / 4


def test_pack_takes_the_whole_step_of_a_sharded_dump_and_inspect_says_it_is_sharded(tmp_path):
    paths, originals = _write_ranks(tmp_path / "dumps", world=2)
    refused = CliRunner().invoke(main, ["pack", str(paths[1]), "-o", str(tmp_path / "part.tar.zst")])
    assert refused.exit_code == 2 and "Pack its step directory" in refused.output, refused.output
    packed = CliRunner().invoke(main, ["pack", str(paths[1].parent), "-o", str(tmp_path / "step.tar.zst")])
    assert packed.exit_code == 0, packed.output
    _assert_state_equals(open_dump(tmp_path / "step.tar.zst", rank=1), originals)
    shown = CliRunner().invoke(main, ["inspect", str(paths[1])])
    assert shown.exit_code == 0 and "state: sharded" in shown.output, shown.output


FUZZ_VALUES = [
    5,
    -1,
    0,
    "x",
    [1],
    [0, 0],
    [1 << 40, 1],
    {},
    None,
    True,
    2**63,
    1e308,
    "../../escaped",
    "model.safetensors",
    "copy-00000-model.safetensors",
    "\x1b]0;pwned\x07",
    [[[[]]]],
]


def test_fuzzed_sharded_layouts_give_dump_errors_never_a_crash_or_a_huge_allocation(tmp_path):
    """Random nodes of a sharded manifest's `layout` (tables, shards and buddy copies) replaced by hostile values:
    reading the state and verifying the step either succeed or raise DumpError; nothing else escapes."""
    import random
    import resource

    from forensics.core.errors import DumpError

    rng = random.Random(20261126)
    pristine, _ = _box_dumps(tmp_path / "pristine", ROWS, copies=True)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = {"ok": 0, "refused": 0}
    for trial in range(200):
        root = tmp_path / f"m{trial}"
        shutil.copytree(pristine[0].parents[2], root)
        paths = [root / p.relative_to(pristine[0].parents[2]) for p in pristine]
        if trial % 2:
            shutil.rmtree(paths[0])  # half the time the copies must stand in for rank 0

        def mutate(manifest):
            nodes, stack = [], [manifest["layout"]]
            while stack:
                node = stack.pop()
                for key, child in node.items() if isinstance(node, dict) else enumerate(node):
                    nodes.append((node, key))
                    if isinstance(child, (dict, list)):
                        stack.append(child)
            parent, key = rng.choice(nodes)
            parent[key] = rng.choice(FUZZ_VALUES)

        _edit_manifest(paths[1], mutate)
        try:
            state = open_dump(paths[1]).model_state()
            assert state["grid"].numel() <= 24
            outcomes["ok"] += 1
        except DumpError:
            outcomes["refused"] += 1
        try:
            verify_dump(paths[1].parent)  # reports problems as a list; a manifest it cannot read is a DumpError
        except DumpError:
            pass
        shutil.rmtree(root)
    assert outcomes["refused"] > 50 and outcomes["ok"] >= 1, outcomes  # the sweep reached the readers too
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss < 512 * 1024  # KiB: no huge allocation
