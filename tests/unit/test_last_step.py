"""The state a survivor keeps after a failure, in one process: the file, what a load picks, what
is set aside, what a full disk leaves, and what a failing script says and resumes from.

Several ranks (a rank killed, a node whose folder lacks the state) run in tests/e2e with real
processes."""

from __future__ import annotations

import json
import os
import select
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from phalanx.launch.keep_request import ask_to_keep, read_report, wait_for_reports
from phalanx.runtime.checkpoint import CheckpointManager, last_step
from phalanx.runtime.context import init
from phalanx.worker_env import WorkerEnv
from tests.conftest import WORKERS

WORKER = WORKERS / "dies_in_a_step.py"
LAUNCH, EARLIER_LAUNCH = 0x5EED, 0xA11


def model_state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "epoch": 1}


def template() -> dict:
    return {"model": {"w": torch.zeros(3)}}


@pytest.fixture
def manager(tmp_path):
    return CheckpointManager(tmp_path, init())


def test_the_first_copy_is_kept_loaded_when_newest_and_removed_by_the_next_checkpoint(manager, tmp_path):
    manager.save(10, model_state(10.0))
    path, kept = manager.save_last_step(13, LAUNCH, model_state(13.0))
    assert kept and path == tmp_path / "last-step" / f"step-000000013-{LAUNCH:016x}.pt"
    assert manager.save_last_step(13, LAUNCH, model_state(99.0)) == (path, False)  # another survivor, later: dropped
    latest = manager.load_latest(into=template())
    assert latest.survivor and latest.step == 13 and latest.rank_state is None and latest.world_size == 1
    assert torch.equal(latest.state["model"]["w"], torch.full((3,), 13.0)) and latest.state["epoch"] == 1
    manager.save(20, model_state(20.0))
    assert last_step.kept(tmp_path) == []
    assert [p.name for p in (tmp_path / "last-step").iterdir()] == []  # no temporary file left either


def test_a_preferred_copy_replaces_the_one_kept(manager):
    manager.save_last_step(5, LAUNCH, model_state(1.0))
    assert manager.save_last_step(5, LAUNCH, model_state(2.0), preferred=True)[1]
    assert torch.equal(manager.load_latest(into=template()).state["model"]["w"], torch.full((3,), 2.0))


def test_a_state_older_than_the_newest_checkpoint_is_not_used(manager, tmp_path):
    manager.save_last_step(7, LAUNCH, model_state(7.0))
    manager.save(10, model_state(10.0))  # removes it; one left by hand is passed over all the same
    last_step.write(tmp_path, 8, LAUNCH, {}, {})
    latest = manager.load_latest(into=template())
    assert not latest.survivor and latest.step == 10


def test_survivors_one_step_apart_resume_at_the_lower_and_say_so(manager, capsys):
    manager.save_last_step(3, EARLIER_LAUNCH, model_state(3.0))  # an earlier failure's
    manager.save_last_step(14, LAUNCH, model_state(14.0))
    manager.save_last_step(15, LAUNCH, model_state(15.0))
    latest = manager.load_latest(into=template())
    assert latest.step == 14 and torch.equal(latest.state["model"]["w"], torch.full((3,), 14.0))
    assert "survivors kept the state after step 14 and after step 15; resuming after step 14" in capsys.readouterr().err


def test_a_failure_one_step_after_a_resume_from_a_kept_state_resumes_at_the_newer(manager, capsys):
    """The state after step 14 was resumed from; the relaunch failed again after step 15. The two
    files are of two launches, not two survivors of one failure: the newer one counts."""
    manager.save_last_step(14, EARLIER_LAUNCH, model_state(14.0))
    manager.save_last_step(15, LAUNCH, model_state(15.0))
    assert manager.load_latest(into=template()).step == 15
    assert "survivors kept" not in capsys.readouterr().err


def flip_a_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    position = data.index(torch.full((3,), 13.0).numpy().tobytes())  # the tensor's bytes, inside the zip
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (flip_a_tensor_byte, "its tensors are altered (their CRC-32 differs from its header's)"),
        (lambda path: path.write_bytes(path.read_bytes()[:300]), "it does not load (RuntimeError"),
        (lambda path: path.write_bytes(b"PK\x03\x04" + bytes(300)), "it does not load ("),
    ],
    ids=["altered", "truncated", "garbage"],
)
def test_a_damaged_state_is_set_aside_and_the_checkpoint_used(manager, tmp_path, capsys, damage, said):
    manager.save(10, model_state(10.0))
    path, _ = manager.save_last_step(13, LAUNCH, model_state(13.0))
    damage(path)
    latest = manager.load_latest(into=template())
    assert latest.step == 10 and not latest.survivor
    err = capsys.readouterr().err
    assert f"the state a survivor kept after step 13, {path}, does not check out ({said}" in err, err
    assert f"kept as {path.name}.damaged" in err
    assert "steps after it and up to step 13 are trained again" in err
    assert [p.name for p in (tmp_path / "last-step").iterdir()] == [f"{path.name}.damaged"]


def test_a_state_of_another_model_is_set_aside(manager, capsys):
    manager.save_last_step(13, LAUNCH, {"model": {"w": torch.zeros(5)}})
    assert manager.load_latest(into=template()) is None
    err = capsys.readouterr().err
    assert "it is of another model or job: state/model/w is (5,) torch.float32 there, (3,) torch.float32 here" in err


def test_no_room_for_the_state_leaves_nothing_behind(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs mount here (needs root): {mounted.stderr.decode().strip()}")
    try:
        manager = CheckpointManager(folder, init())
        with pytest.raises(OSError):
            manager.save_last_step(4, LAUNCH, {"model": {"w": torch.zeros(64 * 1024)}})  # 256 KiB
        assert [p.name for p in (folder / "last-step").iterdir()] == []
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)


def train(folder: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    out = folder / "summary.json"
    out.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, str(WORKER), "--checkpoint-dir", str(folder / "ck"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    return done, json.loads(out.read_text()) if out.exists() else None


def test_a_script_that_fails_in_a_backward_resumes_after_the_last_step_exactly(tmp_path):
    """Dropout and noise draw random numbers every step: the restart rebuilds them from the step."""
    _, whole = train(tmp_path / "whole")
    failed, _ = train(tmp_path / "failed", "--fail-step", "15")
    assert failed.returncode == 1
    (kept,) = (tmp_path / "failed" / "ck" / "last-step").glob("step-000000015-*.pt")
    assert ("phalanx: the training failed after step 15 (Injected: injected failure in the backward of step 16); "
            "keeping the state after step 15 for a restart\n") in failed.stderr  # fmt: skip
    said = f"phalanx: this rank kept the state after step 15 in {kept}: a restart resumes there\n"
    assert said in failed.stderr
    assert failed.stderr.index(said) < failed.stderr.index("Traceback")  # then the error
    again, resumed = train(tmp_path / "failed")
    assert again.returncode == 0, again.stderr
    assert f"resumed from step 15 ({kept})" in again.stdout
    assert resumed["resumed_from_step"] == 15 and resumed["params_sha256"] == whole["params_sha256"]


def test_a_failure_after_the_optimizer_step_keeps_nothing_and_says_what_is_lost(tmp_path):
    _, whole = train(tmp_path / "whole")
    failed, _ = train(tmp_path / "failed", "--fail-step", "15", "--fail-where", "optimizer")
    assert failed.returncode == 1
    assert (
        "phalanx: the training failed in step 16 after its optimizer step began, before run.step() (Injected: "
        "injected failure after the optimizer step of step 16): this rank's state is past step 15, so it keeps "
        "none; unless another rank kept it, a restart resumes from the checkpoint of step 10 and trains steps "
        "11-15 again"
    ) in failed.stderr
    assert not (tmp_path / "failed" / "ck" / "last-step").exists()
    again, resumed = train(tmp_path / "failed")
    assert resumed["resumed_from_step"] == 10 and resumed["params_sha256"] == whole["params_sha256"], again.stderr


def test_a_run_closed_in_a_finally_still_keeps_the_state(tmp_path):
    """The finally's run.close() runs before sys.excepthook: the close keeps the state itself."""
    _, whole = train(tmp_path / "whole")
    failed, _ = train(tmp_path / "failed", "--fail-step", "15", "--close-in-finally")
    assert failed.returncode == 1 and "phalanx: this rank kept the state after step 15 in " in failed.stderr, (
        failed.stderr
    )
    assert failed.stderr.count("keeping the state after step 15") == 1  # once, not again from the hook
    again, resumed = train(tmp_path / "failed", "--close-in-finally")
    assert resumed["resumed_from_step"] == 15 and resumed["params_sha256"] == whole["params_sha256"], again.stderr


def test_a_rank_waiting_for_a_silent_peer_keeps_the_state_when_its_launcher_asks(tmp_path):
    """The rank waits for ever in step 16 (as in a collective whose peer went silent: nothing
    raises); the launcher's words on its keep request make it keep the state after step 15 and
    write its report, and it runs on until the launcher stops it. A restart resumes exactly."""
    _, whole = train(tmp_path / "whole")
    request, stderr = tmp_path / "keep-request", tmp_path / "stderr.log"
    command = [sys.executable, str(WORKER), "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "out.json"),
               "--fail-step", "15", "--fail-where", "wait"]  # fmt: skip
    with stderr.open("w") as errors:
        waiting = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True,
                                   env={**os.environ, **WorkerEnv(keep_request=str(request)).to_env()})  # fmt: skip
    try:
        ready, _, _ = select.select([waiting.stdout], [], [], 120)
        assert ready and waiting.stdout.readline() == "waiting in step 16\n", stderr.read_text()
        assert stat.S_ISFIFO(request.stat().st_mode)
        why = "node1: node 10.0.0.2 sent no sign of life for 35 s, so its launcher stopped this rank"
        assert ask_to_keep([tmp_path / "nobody-listens", request], why) == [request]
        wait_for_reports([request], [psutil.Process(waiting.pid)], timeout=60)
        assert waiting.poll() is None, "the rank ended before its launcher stopped it"
    finally:
        waiting.kill()
        waiting.wait()
    (kept,) = (tmp_path / "ck" / "last-step").glob("step-000000015-*.pt")
    assert read_report(request) == f"this rank kept the state after step 15 in {kept}: a restart resumes there"
    assert f"phalanx: the training failed after step 15 ({why}); keeping the state after step 15 for a restart\n" in (
        stderr.read_text()
    )
    again, resumed = train(tmp_path)
    assert resumed["resumed_from_step"] == 15 and resumed["params_sha256"] == whole["params_sha256"], again.stderr


def test_a_keep_request_nobody_listens_on_is_passed_over(tmp_path):
    """A run that ended released its request (the FIFO is gone); one whose reader is gone, or
    missing, is passed over without blocking."""
    request = tmp_path / "keep-request"
    done = subprocess.run([sys.executable, str(WORKER), "--checkpoint-dir", str(tmp_path / "ck"), "--out",
                           str(tmp_path / "summary.json"), "--epochs", "1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **WorkerEnv(keep_request=str(request)).to_env()})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not request.exists() and read_report(request) is None
    os.mkfifo(request)  # one whose reader is gone (a rank killed)
    assert ask_to_keep([request, tmp_path / "missing"], "words") == []


def test_waiting_for_reports_leaves_the_exit_status_to_torchs_agent(tmp_path):
    """The launcher's wait ends when its workers ended, without reaping them: torch's agent then
    reads each one's exit status (a reaped child would read as 0, a failure as a success)."""
    child = subprocess.Popen([sys.executable, "-c", "import time, os; time.sleep(0.3); os._exit(1)"])
    started = time.monotonic()
    wait_for_reports([tmp_path / "keep-request"], [psutil.Process(child.pid)], timeout=30)
    assert time.monotonic() - started < 10
    assert child.wait(timeout=10) == 1
