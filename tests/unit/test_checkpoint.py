"""Checkpoints in one process: commit marker, CRC check, fallback, pruning, safe loading.

Several ranks (DCP's spread of the replicated state, node-local folders, async saves) run in
tests/e2e/test_checkpoints.py with real processes.
"""

import contextlib
import json
import os
import pickle
import subprocess

import pytest
import torch

from phalanx.errors import CheckpointNotSaved, SettingsRefused
from phalanx.runtime.checkpoint import CheckpointManager, folder, restore_rng_state, rng_state
from phalanx.runtime.checkpoint.encoding import NotStorable
from phalanx.runtime.checkpoint.lock import LOCK_NAME
from phalanx.runtime.checkpoint.reader import SafeReader
from phalanx.runtime.context import init


def names(folder):
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)


def data_file(folder, step):
    return folder / f"step-{step:09d}" / "__0_0.distcp"


def test_save_load_prune_and_fall_back(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, init(), keep=2)
    for step in (10, 20, 30):
        manager.save(step, {"model": {"w": torch.full((3,), float(step))}, "epoch": step // 10})
    assert names(tmp_path) == ["step-000000020", "step-000000030"]  # the oldest was pruned, no staging left

    latest = manager.load_latest()
    assert latest.step == 30 and torch.equal(latest.state["model"]["w"], torch.full((3,), 30.0))

    newest = data_file(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a crash mid-copy
    fallback = manager.load_latest()
    assert fallback.step == 20 and fallback.state["epoch"] == 2
    assert "is damaged (__0_0.distcp is truncated or altered" in capsys.readouterr().err
    assert names(tmp_path) == ["step-000000020", "step-000000030.damaged"]


def test_a_stray_file_is_named_and_left_and_a_missing_one_is_damage(tmp_path, capsys):
    """An NFS .nfsXXXX or a note beside the checkpoint's files does not damage it; a file its
    marker lists that is gone does, and the message names it."""
    manager = CheckpointManager(tmp_path, init())
    manager.save(10, {"w": torch.ones(2)})
    manager.save(20, {"w": torch.full((2,), 2.0)})
    stray = tmp_path / "step-000000020" / ".nfs000000000123"
    stray.write_text("held open by another client")
    latest = manager.load_latest()
    assert latest.step == 20 and stray.exists()
    said = capsys.readouterr().err
    assert "step-000000020 holds the file .nfs000000000123 that its marker does not list: not phalanx's, left" in said
    assert "damaged" not in said
    data_file(tmp_path, 20).unlink()
    assert manager.load_latest().step == 10
    assert (
        "step-000000020 is damaged (the file __0_0.distcp listed by its marker phalanx.json is missing)"
        in capsys.readouterr().err
    )


def test_plain_values_round_trip_as_they_were(tmp_path):
    """Int dict keys (an optimizer's state), tuples, None, nan: JSON alone would change them."""
    manager = CheckpointManager(tmp_path, init())
    state = {"opt": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"params": [0], "lr": 0.1}]},
             "pos": (1, 2), "none": None, "nan": float("nan"), "text": "é"}  # fmt: skip
    manager.save(1, state)
    loaded = manager.load_latest().state
    assert loaded["opt"]["state"][0]["step"].item() == 3.0 and loaded["opt"]["groups"] == [{"params": [0], "lr": 0.1}]
    assert (
        loaded["pos"] == (1, 2) and loaded["none"] is None and loaded["nan"] != loaded["nan"] and loaded["text"] == "é"
    )


def test_a_value_that_is_not_plain_is_refused_with_its_path(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    with pytest.raises(NotStorable, match=r"state/model/fn: a builtins.function"):
        manager.save(1, {"model": {"fn": lambda: None}})
    assert names(tmp_path) == []


def test_loading_fills_the_given_tensors_in_place(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"model": {"w": torch.arange(4.0)}})
    target = torch.zeros(4)
    loaded = manager.load_latest(into={"model": {"w": target}})
    assert loaded.state["model"]["w"] is target and torch.equal(target, torch.arange(4.0))


def test_rng_states_come_back(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    torch.manual_seed(1)
    manager.save(1, {}, {"rng": rng_state()})
    expected = torch.rand(4)
    torch.rand(100)
    restore_rng_state(manager.load_latest().rank_state["rng"])
    assert torch.equal(torch.rand(4), expected)


def test_a_folder_without_its_marker_is_not_a_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    manager.save(5, {"x": 1})
    (tmp_path / "step-000000005" / "phalanx.json").unlink()
    assert manager.load_latest() is None


def test_garbage_of_the_right_size_falls_back(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"x": 1})
    manager.save(2, {"x": 2})
    newest = data_file(tmp_path, 2)
    newest.write_bytes(b"\0" * newest.stat().st_size)
    assert manager.load_latest().state == {"x": 1}
    assert "step-000000002 is damaged (__0_0.distcp is truncated or altered" in capsys.readouterr().err


def test_every_checkpoint_damaged_is_said_before_training_starts_from_step_0(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, init())
    for step in (1, 2):
        manager.save(step, {"x": step})
        data_file(tmp_path, step).write_bytes(b"\0" * 8)
    assert manager.load_latest() is None
    said = capsys.readouterr().err
    assert said.count("is damaged") == 2
    assert f"none of the 2 checkpoint(s) in {tmp_path} checks out" in said and "training starts from step 0" in said
    assert names(tmp_path) == ["step-000000001.damaged", "step-000000002.damaged"]  # kept, never deleted


def test_a_marker_of_another_format_is_refused_plainly(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"x": 1})
    marker = tmp_path / "step-000000001" / "phalanx.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": 1}))
    assert manager.load_latest() is None
    assert "its marker phalanx.json is not readable: format 1, this version reads 2" in capsys.readouterr().err


def test_pruning_never_counts_a_damaged_checkpoint(tmp_path):
    """The newest was damaged and the run fell back: with keep=2, the next saves must keep the
    valid ones they made and the one fallen back to, never the damaged one."""
    manager = CheckpointManager(tmp_path, init(), keep=2)
    for step in (10, 20):
        manager.save(step, {"step": step})
    damaged = data_file(tmp_path, 20)
    damaged.write_bytes(damaged.read_bytes()[:50])
    assert manager.load_latest().step == 10
    manager.save(11, {"step": 11})
    assert names(tmp_path) == ["step-000000010", "step-000000011", "step-000000020.damaged"]
    manager.save(12, {"step": 12})
    assert names(tmp_path) == ["step-000000011", "step-000000012", "step-000000020.damaged"]


def test_the_staging_folder_of_a_crashed_save_is_removed(tmp_path):
    (tmp_path / ".step-000000005.staging").mkdir()
    (tmp_path / ".step-000000005.staging" / "__0_0.distcp").write_bytes(b"partial")
    manager = CheckpointManager(tmp_path, init())
    assert names(tmp_path) == []  # at the start, before anything could be trained
    manager.save(6, {})
    assert names(tmp_path) == ["step-000000006"]


def test_an_async_save_commits_by_the_next_wait(tmp_path):
    manager = CheckpointManager(tmp_path, init(), async_save=True)
    weights = torch.zeros(1000)
    manager.save(1, {"w": weights})
    weights += 1  # the training goes on: the save wrote the copy it took
    manager.wait()
    assert torch.equal(manager.load_latest().state["w"], torch.zeros(1000))
    manager.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a disk that fills up (needs root to mount; CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    folder = tmp_path / "disk"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True, timeout=10)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], timeout=10)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_is_said_plainly_and_loses_nothing(small_disk, async_save):
    manager = CheckpointManager(small_disk, init(), async_save=async_save)
    manager.save(1, {"w": torch.zeros(1000)})
    with pytest.raises(CheckpointNotSaved) as refused:
        manager.save(2, {"w": torch.zeros(300_000)})  # 1.2 MB: more than the disk holds
        manager.wait()
    assert "the disk is full" in refused.value.what and "step-000000001) is intact" in refused.value.why
    assert refused.value.hint and refused.value.exit_code == 1
    assert names(small_disk) == ["step-000000001"]
    assert manager.load_latest().step == 1


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "ckpt").write_text("")
    with pytest.raises(SettingsRefused, match="the checkpoint folder .*ckpt is a file") as refused:
        CheckpointManager(tmp_path / "ckpt", init())
    assert "that can be written" in refused.value.hint and refused.value.exit_code == 2


def test_a_full_disk_is_refused_before_training(small_disk):
    """The probe saw a disk that was full from the start found only at the first save, 50 steps in."""
    with contextlib.suppress(OSError):
        (small_disk / "filler").write_bytes(b"x" * 2**20)  # fills the 1 MiB disk
    with pytest.raises(SettingsRefused, match="is full") as refused:
        CheckpointManager(small_disk / "ck", init())
    assert refused.value.exit_code == 2


def test_a_relaunch_measures_the_disk_by_the_newest_checkpoint(small_disk):
    """Before the first step an optimizer has no buffers: the state then is far smaller than what
    the next save writes. The newest checkpoint's files are the measure (here 0.6 MB, of a disk
    with 0.4 MB left), not the state given (4 kB)."""
    manager = CheckpointManager(small_disk, init())
    manager.save(1, {"w": torch.zeros(150_000)})  # 0.6 MB on the 1 MiB disk
    with pytest.raises(
        SettingsRefused, match=r"needs about 0\.6 MiB \(the newest, step-000000001, takes that much\)"
    ) as refused:
        manager.check({"w": torch.zeros(1000)})  # the model alone: the optimizer's moments not yet made
    assert refused.value.exit_code == 2


def test_checkpoints_of_the_earlier_format_are_refused_not_ignored(tmp_path):
    """Ignored, they would let the run start over in a folder the user takes for resumable."""
    (tmp_path / "step-000000100.pt").write_bytes(b"an earlier phalanx checkpoint")
    with pytest.raises(SettingsRefused, match="holds checkpoints of an earlier phalanx format") as refused:
        CheckpointManager(tmp_path, init())
    assert "step-000000100.pt" in refused.value.what and refused.value.exit_code == 2


def test_a_step_saved_again_replaces_it_and_a_crash_between_puts_the_old_one_back(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    manager.save(4, {"x": 1})
    manager.save(4, {"x": 2})
    assert names(tmp_path) == ["step-000000004"] and manager.load_latest().state == {"x": 2}
    (tmp_path / "step-000000004").rename(tmp_path / ".step-000000004.replaced")  # a crash between the renames
    manager = CheckpointManager(tmp_path, init())
    assert names(tmp_path) == ["step-000000004"] and manager.load_latest().state == {"x": 2}


class RunsCode:
    def __reduce__(self):
        return (print, ("code ran",))


def test_a_crafted_metadata_file_cannot_run_code_even_with_its_crc_updated(tmp_path, capsys):
    """torch's own reader unpickles .metadata as it is; a file made to run code falls back."""
    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"x": 1})
    manager.save(2, {"x": 2})
    newest = tmp_path / "step-000000002"
    (newest / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    marker = json.loads((newest / "phalanx.json").read_text())
    marker["files"][".metadata"] = folder.file_facts(
        newest / ".metadata"
    )  # the check passes: the unpickling must refuse
    (newest / "phalanx.json").write_text(json.dumps(marker))
    assert manager.load_latest().state == {"x": 1}
    out, err = capsys.readouterr()
    assert "code ran" not in out and "its .metadata is not DCP's metadata (builtins.print is not something" in err


def test_a_crafted_bytes_entry_is_damage_and_never_reaches_unpickling(tmp_path, capsys):
    """A BytesStorageMetadata entry would make DCP's load unpickle that value with
    weights_only=False. Written by torch's own classes, with the marker's CRCs updated: the
    checkpoint is set aside and the previous one loads."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"x": 1})
    manager.save(2, {"x": 2})
    newest = tmp_path / "step-000000002"
    metadata = SafeReader(str(newest)).read_metadata()
    metadata.state_dict_metadata["payload"] = BytesStorageMetadata()
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    marker = json.loads((newest / "phalanx.json").read_text())
    marker["files"][".metadata"] = folder.file_facts(newest / ".metadata")
    (newest / "phalanx.json").write_text(json.dumps(marker))
    assert manager.load_latest().state == {"x": 1}
    assert (
        "step-000000002 is damaged (its .metadata is not DCP's metadata (it lists a pickled value"
        in capsys.readouterr().err
    )
    assert names(tmp_path) == ["step-000000001", "step-000000002.damaged"]


def test_a_checkpoint_that_cannot_be_read_is_refused_not_set_aside(tmp_path, monkeypatch):
    """An I/O error (mocked: a failing disk cannot be made here) is not damage: setting the
    checkpoint aside would start the training over from an older one, or from nothing."""
    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"x": 1})

    def failing_read(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(folder, "file_facts", failing_read)
    with pytest.raises(SettingsRefused, match="it cannot be read: Input/output error") as refused:
        manager.load_latest()
    assert "permissions" in refused.value.hint and names(tmp_path) == ["step-000000001"]


def test_two_tensors_that_would_share_a_path_are_refused(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    with pytest.raises(NotStorable, match="state/m/1: two tensors of the state would be stored under this one path"):
        manager.save(1, {"m": {1: torch.zeros(1), "1": torch.ones(1)}})
