"""Checkpoints in one process: atomic files, checksums, fallback, pruning, weights-only loading."""

import contextlib
import hashlib
import os
import subprocess

import pytest
import torch

from phalanx.errors import CheckpointNotSaved, SettingsRefused
from phalanx.runtime.checkpoint import CheckpointManager, restore_rng_state
from phalanx.runtime.context import init


def test_save_load_prune_and_fall_back(tmp_path, capsys):
    context = init()  # no torchrun variables: one process, no process group
    manager = CheckpointManager(tmp_path, context, keep=2)
    for step in (10, 20, 30):
        manager.save(step, {"model": {"w": torch.full((3,), float(step))}, "epoch": step // 10})
    assert [step for step, _ in manager.checkpoints()] == [30, 20]  # the oldest was pruned
    assert not list(tmp_path.glob(".*"))  # no temporary files left

    latest = manager.load_latest()
    assert latest.step == 30 and torch.equal(latest.state["model"]["w"], torch.full((3,), 30.0))

    newest = manager.path_for(30)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a crash mid-copy
    fallback = manager.load_latest()
    assert fallback.step == 20 and fallback.state["epoch"] == 2
    assert "is damaged (checksum mismatch" in capsys.readouterr().err


def test_a_file_without_its_checksum_is_not_trusted(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    manager.save(5, {"x": 1})
    manager.path_for(5).with_suffix(".sha256").unlink()
    assert manager.load_latest() is None


def test_rng_states_come_back(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    torch.manual_seed(1)
    manager.save(1, {})
    expected = torch.rand(4)
    torch.rand(100)
    restore_rng_state(manager.load_latest().rng)
    assert torch.equal(torch.rand(4), expected)


def test_loading_cannot_run_code(tmp_path, capsys):
    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"x": 1})
    path = manager.path_for(1)
    torch.save({"format": 1, "step": 1, "state": Payload()}, path)
    path.with_suffix(".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())
    assert manager.load_latest() is None  # refused, and set aside: never loaded
    out, err = capsys.readouterr()
    assert "code ran" not in out
    assert "is damaged (it holds objects that are not tensors or plain values)" in err


def test_garbage_with_a_matching_checksum_falls_back_without_advising_unsafe_loading(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"x": 1})
    manager.save(2, {"x": 2})
    newest = manager.path_for(2)
    newest.write_bytes(b"not a checkpoint at all" * 100)
    newest.with_suffix(".sha256").write_text(hashlib.sha256(newest.read_bytes()).hexdigest())
    assert manager.load_latest().state == {"x": 1}
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged (it does not load" in err and "weights_only=False" not in err


def test_pruning_never_counts_a_damaged_checkpoint(tmp_path):
    """The newest was damaged and the run fell back: with keep=2, the next saves must keep the
    valid ones they made and the one fallen back to, never the damaged file."""
    manager = CheckpointManager(tmp_path, init(), keep=2)
    for step in (10, 20):
        manager.save(step, {"step": step})
    damaged = manager.path_for(20)
    damaged.write_bytes(damaged.read_bytes()[:50])
    assert manager.load_latest().step == 10
    assert (tmp_path / "step-000000020.pt.damaged").exists()  # kept for a look, out of the count
    manager.save(11, {"step": 11})
    assert [step for step, _ in manager.checkpoints()] == [11, 10]
    manager.save(12, {"step": 12})
    assert [step for step, _ in manager.checkpoints()] == [12, 11]


def test_temporaries_of_a_crashed_save_are_removed(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    for name in (".step-000000005.pt.staging-1", "..step-000000005.pt.staging-1.tmp-1", ".step-000000005.sha256.tmp-1"):
        (tmp_path / name).write_bytes(b"partial")
    manager.save(6, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000006.pt", "step-000000006.sha256"]


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


def test_a_full_disk_is_said_plainly_and_loses_nothing(small_disk):
    manager = CheckpointManager(small_disk, init())
    manager.save(1, {"w": torch.zeros(1000)})
    with pytest.raises(CheckpointNotSaved) as refused:
        manager.save(2, {"w": torch.zeros(300_000)})  # 1.2 MB: more than the disk holds
    assert "the disk is full" in refused.value.what and "step-000000001.pt) is intact" in refused.value.why
    assert refused.value.hint and refused.value.exit_code == 1
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-000000001.pt", "step-000000001.sha256"]
    assert manager.load_latest().step == 1


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "ckpt").write_text("")
    with pytest.raises(SettingsRefused, match="the checkpoint folder .*ckpt is a file") as refused:
        CheckpointManager(tmp_path / "ckpt", init())
    assert "writable folder" in refused.value.hint and refused.value.exit_code == 2


def test_a_full_disk_is_refused_before_training(small_disk):
    """The probe saw a disk that was full from the start found only at the first save, 50 steps in."""
    with contextlib.suppress(OSError):
        (small_disk / "filler").write_bytes(b"x" * 2**20)  # fills the 1 MiB disk
    with pytest.raises(SettingsRefused, match="is full") as refused:
        CheckpointManager(small_disk / "ck", init())
    assert refused.value.exit_code == 2
