"""Positional sample IDs are decided in one place (forensics/format/sample_ids.py) for the job and the replay."""

from forensics.format.sample_ids import ids_are_positional, positional_ids, written_ids


def test_positional_ids_count_micro_batches_from_one_with_what_is_known_of_the_place():
    assert positional_ids(0, 2, step=5, rank=3) == ["step5/rank3/mb1/0", "step5/rank3/mb1/1"]
    assert positional_ids(1, 1, step=5) == ["step5/mb2/0"]  # a replay making IDs for a dump that stores none
    assert positional_ids(0, 1) == ["mb1/0"]  # a session built from live objects


def test_what_the_job_writes_the_replay_reads_as_positional_or_not():
    made, positional = written_ids(None, 7, 0, 2, 1)  # the job recorded no IDs
    assert made == ["step7/rank1/mb1/0", "step7/rank1/mb1/1"] and positional
    assert ids_are_positional({"sample_ids": made, "ids_are_positional": positional})
    kept, positional = written_ids(["doc-1", "doc-2"], 7, 0, 2, 1)
    assert kept == ["doc-1", "doc-2"] and not positional
    assert not ids_are_positional({"sample_ids": kept, "ids_are_positional": positional})
    assert written_ids(None, 7, 0, None, 1) == (None, True)  # no size: nothing to make up, still positional
    assert ids_are_positional({"sample_ids": None})  # an older dump that stored no IDs and no flag
    assert not ids_are_positional({"sample_ids": ["step3/rank0/mb0/1"]})  # an older dump keeps its stored IDs
