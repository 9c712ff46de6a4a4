"""Checkpoints in one process: atomic files, checksums, fallback, pruning, weights-only loading."""

import torch

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


def test_loading_cannot_run_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    manager = CheckpointManager(tmp_path, init())
    manager.save(1, {"x": 1})
    path = manager.path_for(1)
    torch.save({"format": 1, "step": 1, "state": Payload()}, path)
    path.with_suffix(".sha256").write_text(__import__("hashlib").sha256(path.read_bytes()).hexdigest())
    try:
        manager.load_latest()
    except Exception as error:  # torch refuses the pickle: weights_only=True
        assert "Weights only load failed" in str(error)
    else:
        raise AssertionError("a checkpoint with code in it was loaded")


def test_temporaries_of_a_crashed_save_are_removed(tmp_path):
    manager = CheckpointManager(tmp_path, init())
    (tmp_path / ".step-000000005.pt.staging-1").write_bytes(b"partial")
    manager.save(6, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000006.pt", "step-000000006.sha256"]
