"""The runtime under real launches: equivalence across world sizes and exact resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from phalanx.runtime.checkpoint.lock import LOCK_NAME
from tests.conftest import EXAMPLES, WORKERS, Completed, kill_group, phalanx_argv, run_command

pytestmark = pytest.mark.slow
TRAIN = str(EXAMPLES / "train.py")


def train(workdir: Path, name: str, *args: str, nproc: int = 1, timeout: float = 180) -> dict:
    """Runs train.py; its --metrics-json, with the --metrics-jsonl records under "records"."""
    out, records = workdir / f"{name}.json", workdir / f"{name}.jsonl"
    argv = [TRAIN, *args, "--metrics-json", str(out), "--save-model", str(workdir / f"{name}.pt"),
            "--metrics-jsonl", str(records)]  # fmt: skip
    command = [sys.executable, *argv] if nproc == 1 else phalanx_argv("run", "--nproc-per-node", str(nproc), *argv)
    result = run_command(command, timeout=timeout, cwd=workdir)
    assert result.returncode == 0, result.output
    return {**json.loads(out.read_text()), "records": read_records(records), "output": result.output}


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# 1792 samples divide evenly by every world size and batch, so no rank sees padding; 112 steps.
EQUIVALENCE_ARGS = ("--samples", "1792", "--epochs", "2", "--lr", "0.05", "--log-every", "8")


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> tuple[Path, dict]:
    """One process, batch 32: what every world size with a 32-sample global batch must match."""
    folder = tmp_path_factory.mktemp("single")
    return folder, train(folder, "w1", *EQUIVALENCE_ARGS, "--batch-size", "32")


def assert_same_training(single: tuple[Path, dict], folder: Path, name: str, world_size: int) -> dict:
    (single_folder, one), other = single, json.loads((folder / f"{name}.json").read_text())
    assert (one["world_size"], other["world_size"]) == (1, world_size)
    assert one["steps"] == other["steps"] == 2 * 1792 // 32
    reference, trained = torch.load(single_folder / "w1.pt"), torch.load(folder / f"{name}.pt")
    for key in reference:
        torch.testing.assert_close(trained[key], reference[key], rtol=1e-4, atol=1e-5)
    assert abs(one["final_loss"] - other["final_loss"]) < 1e-4
    return other


@pytest.mark.parametrize("nproc", [2, 4])
def test_more_processes_with_smaller_batches_give_the_same_model_and_the_same_global_loss(
    workdir, single_process, nproc
):
    multi = train(workdir, f"w{nproc}", *EQUIVALENCE_ARGS, "--batch-size", str(32 // nproc), nproc=nproc)
    assert_same_training(single_process, workdir, f"w{nproc}", nproc)
    # The JSONL file: rank 0 wrote one record per logged step, with the loss of every rank's
    # samples; one rank's own loss would differ from the single process's, which sees them all.
    one, many = single_process[1]["records"], multi["records"]
    assert [r["step"] for r in many] == [r["step"] for r in one] == list(range(8, 113, 8))
    assert {r["world_size"] for r in many} == {nproc} and {r["samples"] for r in many} == {8 * 32}
    assert [r["epoch"] for r in many] == [1] * 7 + [2] * 7
    for mine, reference in zip(many, one):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-4, abs=1e-5), mine["step"]
    assert all(r["samples_per_second"] > 0 and r["step_time_s"] > 0 and r["eta_s"] >= 0 for r in many)
    assert many[-1]["eta_s"] == 0
    assert "step 112/112 (100%)" in multi["output"]  # the progress line, plain in a log
    assert "stall watchdog is off" not in multi["output"]
    epochs, reference_epochs = epoch_lines(multi["output"]), epoch_lines(single_process[1]["output"])
    assert [line[:2] for line in epochs] == [line[:2] for line in reference_epochs] == [(1, 56), (2, 112)]
    for (_, _, mine, _), (_, _, reference, _) in zip(epochs, reference_epochs):  # the epoch's global loss, as printed
        assert float(mine) == pytest.approx(float(reference), abs=2e-4)


def test_accumulated_micro_batches_give_the_same_model(workdir, single_process):
    # 2 processes x 2 micro-batches of 8 per optimizer step: the same 32 samples a step.
    train(workdir, "acc", *EQUIVALENCE_ARGS, "--batch-size", "8", "--accumulate", "2", nproc=2)
    assert_same_training(single_process, workdir, "acc", 2)


def test_accumulation_all_reduces_only_at_the_end_of_a_window(phalanx, workdir):
    script = workdir / "accumulate.py"
    script.write_text((WORKERS / "accumulate.py").read_text())
    result = phalanx("run", "--nproc-per-node", "2", str(script), str(workdir))
    assert result.returncode == 0, result.output
    ranks = [json.loads((workdir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # 8 micro-batches in windows of 4, one bucket: 2 all-reduces instead of 8, each after the one
    # of the settling pass before a model's first step (phalanx.runtime.bucket_layout)
    for mine in ranks:
        assert (mine["accumulate"]["all_reduces"], mine["every_backward"]["all_reduces"]) == (1 + 2, 1 + 8)
        for with_no_sync, without in zip(mine["accumulate"]["gradients"], mine["every_backward"]["gradients"]):
            for a, b in zip(with_no_sync, without):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b))
    # The gradients were all-reduced before clipping: every rank saw the same global norm.
    assert ranks[0]["accumulate"]["norms"] == ranks[1]["accumulate"]["norms"]
    assert all(norm > 0.01 for norm in ranks[0]["accumulate"]["norms"])  # so the clip was active


def test_bf16_autocast_trains_on_cpu(workdir):
    metrics = train(workdir, "bf16", "--epochs", "3", "--precision", "bf16", "--log-every", "5", nproc=2)
    losses = [r["loss"] for r in metrics["records"]]
    assert losses[-1] < 0.5 * losses[0], losses
    assert metrics["accuracy"] > 0.7


def test_fp16_on_cpu_is_refused_with_a_hint(workdir):
    result = run_command([sys.executable, TRAIN, "--precision", "fp16"], timeout=60, cwd=workdir)
    assert result.returncode == 1
    assert "precision fp16 on device cpu" in result.stderr and "HINT: use precision bf16" in result.stderr


def test_clip_grad_bounds_every_update(workdir):
    clip, lr, momentum = 0.01, 0.05, 0.9
    start = train(workdir, "start", "--epochs", "0")  # the same seed: the initial parameters
    clipped = train(workdir, "clipped", "--epochs", "1", "--lr", str(lr), "--clip-grad", str(clip),
                    "--log-every", "1", nproc=2)  # fmt: skip
    assert start["steps"] == 0 and clipped["steps"] == 29  # ceil(ceil(1797 / 2) / 32)
    norms = [r["grad_norm"] for r in clipped["records"]]
    assert len(norms) == 29 and min(norms) > 10 * clip  # the norm before clipping: clipping did act
    # With every gradient clipped to norm c, SGD with momentum moves at most lr * c / (1 - momentum)
    # a step, 0.145 in all here; the same run unclipped moves the weights about 3.2 (measured).
    before, after = torch.load(workdir / "start.pt"), torch.load(workdir / "clipped.pt")
    moved = torch.cat([(after[k] - before[k]).flatten() for k in before]).norm()
    assert 0 < moved <= 29 * lr * clip / (1 - momentum)


# Checkpoints fall between logging points (20 and 40 are no multiples of 6): a resumed run's
# first report must still cover the steps since the last one before the checkpoint.
RESUME_ARGS = ("--epochs", "8", "--batch-size", "16", "--checkpoint-every", "20", "--log-every", "6")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run that interrupted ones must match bit for bit."""
    folder = tmp_path_factory.mktemp("reference")
    metrics = train(folder, "reference", *RESUME_ARGS, "--checkpoint-dir", str(folder / "ck"), nproc=2)
    assert metrics["resumed_from_step"] is None
    return metrics


def interrupt_after_first_checkpoint(
    workdir: Path, interrupt, *launch: str, train_args: tuple[str, ...] = (), nproc: int = 2
) -> tuple[int, str, Path]:
    """Starts train.py under phalanx run, calls interrupt(process) once a checkpoint exists."""
    checkpoints, out = workdir / "ck", workdir / "resumed.json"
    command = phalanx_argv("run", "--nproc-per-node", str(nproc), *launch, TRAIN, *RESUME_ARGS, *train_args, "--checkpoint-dir",
                           str(checkpoints), "--metrics-json", str(out), "--metrics-jsonl", str(workdir / "resumed.jsonl"))  # fmt: skip
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list(checkpoints.glob("step-*[0-9]")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.02)
        interrupt(process)
        output, _ = process.communicate(timeout=180)
    finally:
        kill_group(process.pid)
    return process.returncode, output, out


def relaunch_to_the_end(workdir: Path, out: Path, *train_args: str, nproc: int = 2) -> Completed:
    """The same command again, on the same checkpoint folder: it must train to the end."""
    relaunch = run_command(
        phalanx_argv("run", "--nproc-per-node", str(nproc), TRAIN, *RESUME_ARGS, "--checkpoint-dir", str(workdir / "ck"),
                     "--metrics-json", str(out), *train_args),
        timeout=180, cwd=workdir,
    )  # fmt: skip
    assert relaunch.returncode == 0, relaunch.output
    return relaunch


@pytest.mark.compat
def test_kill_9_of_a_worker_resumes_to_the_same_parameters(workdir, reference):
    def kill_rank_1(process: subprocess.Popen) -> None:
        workers = [p for p in psutil.Process(process.pid).children(recursive=True) if TRAIN in " ".join(p.cmdline())]
        os.kill(next(p for p in workers if p.environ().get("RANK") == "1").pid, signal.SIGKILL)

    code, output, out = interrupt_after_first_checkpoint(workdir, kill_rank_1, "--max-restarts", "2")
    assert code == 0, output
    resumed = json.loads(out.read_text())
    # Rank 0 survived the kill and kept the state after the last step both ranks completed.
    found = re.search(r"rank kept the state after step (\d+) in (\S+): a restart resumes there", output)
    assert found, output
    step, kept = int(found.group(1)), found.group(2)
    assert resumed["resumed_from_step"] == step, output
    # A kill right after a checkpoint's step: the committed checkpoint of that step is the same state.
    checkpoint = workdir / "ck" / f"step-{step:09d}"
    from_checkpoint = f"resumed from step {step} ({checkpoint})" in output
    assert from_checkpoint or f"resumed from step {step} ({kept})" in output, output
    assert resumed["steps"] == reference["steps"]
    assert resumed["params_sha256"] == reference["params_sha256"]
    # The metrics file reads as the uninterrupted run's (every logged step once, the same global
    # losses). From a checkpoint, exactly. From a kept state, but for one point: the losses summed
    # since the last logging point went with the rank that died, so the first point after the
    # resume covers the steps since the resume only; a point at the kept step itself, whose
    # all-reduce was in flight, is not written.
    records, expected = read_records(workdir / "resumed.jsonl"), list(reference["records"])
    first_after = next(index for index, r in enumerate(expected) if r["step"] > step)
    log_every = int(RESUME_ARGS[RESUME_ARGS.index("--log-every") + 1])
    if not from_checkpoint and step % log_every == 0:
        assert expected.pop(first_after - 1)["step"] == step
    elif not from_checkpoint:
        partial, whole = records.pop(first_after), expected.pop(first_after)
        assert partial["step"] == whole["step"] and 0 < partial["samples"] < whole["samples"], (partial, whole)
    assert [r["step"] for r in records] == [r["step"] for r in expected]
    assert [r["samples"] for r in records] == [r["samples"] for r in expected]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in expected], rel=1e-9)


@pytest.mark.compat
def test_a_second_job_on_a_checkpoint_folder_is_refused_and_a_killed_ones_lock_taken_over(workdir):
    """Two jobs in one folder deleted each other's saves in progress. The second is refused,
    naming the first, which goes on; a job killed with SIGKILL leaves its lock behind, and the
    next job takes it over, says so, and removes it at its end."""
    checkpoints = workdir / "ck"
    lock = checkpoints / LOCK_NAME

    def job(epochs: str) -> list[str]:
        return phalanx_argv("run", "--nproc-per-node", "2", TRAIN, "--epochs", epochs, "--batch-size", "16",
                            "--checkpoint-every", "20", "--checkpoint-dir", str(checkpoints))  # fmt: skip

    first = subprocess.Popen(job("1000"), cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not lock.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
            time.sleep(0.05)
        second = run_command(job("1"), timeout=120, cwd=workdir)
        assert second.returncode == 2, second.output
        assert f"the checkpoint folder {checkpoints} is in use by another job" in second.output, second.output
        assert (
            f"launcher PID {first.pid}" in second.output and "HINT: give this job a checkpoint folder" in second.output
        )
        assert first.poll() is None  # the first job goes on
    finally:
        kill_group(first.pid)
        first.communicate()
    assert lock.exists()  # SIGKILL: nothing removed it
    third = run_command(job("1"), timeout=120, cwd=workdir)
    assert third.returncode == 0, third.output
    assert "taking over the lock of a job that is gone (job " in third.output, third.output
    assert f"launcher PID {first.pid}" in third.output
    assert not lock.exists()  # removed at the end of the job that held it


@pytest.mark.compat
@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigterm_saves_together_and_a_relaunch_continues_exactly(workdir, reference, workers):
    """With DataLoader workers too: they are handed batches ahead of the loop, which a resume
    from the sampler's own position would skip (the reference run has no workers)."""
    train_args = ("--workers", workers)
    code, output, out = interrupt_after_first_checkpoint(workdir, lambda p: p.send_signal(signal.SIGTERM),
                                                         train_args=train_args)  # fmt: skip
    assert code == 128 + signal.SIGTERM, output
    stopped = re.search(r"preempted by SIGTERM after step (\d+); checkpoint saved", output)
    assert stopped, output
    assert (workdir / "ck" / f"step-{int(stopped.group(1)):09d}" / "phalanx.json").exists()
    assert not out.exists()

    relaunch = relaunch_to_the_end(workdir, out, *train_args, "--metrics-jsonl", str(workdir / "resumed.jsonl"))
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from_step"] == int(stopped.group(1))
    assert resumed["params_sha256"] == reference["params_sha256"]
    # The checkpoint carried the global sums: when the stop falls between two logging points (5
    # stops in 6; the kill -9 test above always resumes between two), the first report after it
    # still covers the steps before the stop, as the uninterrupted run's did.
    records, expected_records = read_records(workdir / "resumed.jsonl"), reference["records"]
    assert [(r["step"], r["samples"]) for r in records] == [(r["step"], r["samples"]) for r in expected_records]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in expected_records], rel=1e-9)
    # Epoch losses travel with the next logging point's all-reduce; the stop showed the epochs
    # that ended before it (one that ended after the last logging point too), with the same losses,
    # and the relaunch the others, the one it resumed in the middle of included.
    stopped_at, expected = int(stopped.group(1)), epoch_lines(reference["output"])
    assert epoch_lines(output) == [line for line in expected if line[1] <= stopped_at], output
    assert epoch_lines(relaunch.output) == [line for line in expected if line[1] > stopped_at], relaunch.output


def test_ctrl_c_saves_together_and_a_relaunch_continues_exactly(workdir, reference):
    """Ctrl-C reaches the launcher alone (the workers run in sessions of their own), which passes
    SIGINT on: the ranks stop after an agreed step and save, as for SIGTERM, with no traceback,
    and the launcher says what they did."""
    code, output, out = interrupt_after_first_checkpoint(workdir, lambda p: p.send_signal(signal.SIGINT))
    assert code == 128 + signal.SIGINT, output
    stopped = re.search(r"stopped by Ctrl-C \(SIGINT\) after step (\d+); checkpoint saved", output)
    assert stopped, output
    assert f"node0 stopped by SIGINT; its workers stopped after step {stopped.group(1)}; checkpoint saved" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    relaunch_to_the_end(workdir, out)
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from_step"] == int(stopped.group(1))
    assert resumed["params_sha256"] == reference["params_sha256"]


@pytest.mark.cluster  # three launches of four ranks, a minute of both cores: the second stage's
def test_four_ranks_resume_bit_for_bit(workdir):
    """With more than two ranks a float sum depends on the order: the first step after a resume
    must reduce its gradients in DDP's rebuilt bucket layout, as the uninterrupted run did at that
    step (phalanx.runtime.bucket_layout); two ranks cannot show it, a + b has one order."""
    reference = train(workdir, "reference4", *RESUME_ARGS, nproc=4)
    code, output, out = interrupt_after_first_checkpoint(workdir, lambda p: p.send_signal(signal.SIGTERM), nproc=4)
    assert code == 128 + signal.SIGTERM, output
    relaunch_to_the_end(workdir, out, nproc=4)
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from_step"] is not None
    assert resumed["params_sha256"] == reference["params_sha256"]


def test_an_epoch_that_ended_after_the_last_logging_point_is_shown_before_the_checkpoint(workdir):
    """Epoch 1 ends at step 57, the checkpoint is at step 60 and no step is logged before the
    end (--log-every 1000): only the settling before the save can show epoch 1, in a collective
    of its own. The job is killed as soon as that checkpoint exists, long before its end."""
    train_args = ("--epochs", "20", "--log-every", "1000", "--checkpoint-every", "60")
    interrupt_after_first_checkpoint(workdir, lambda p: os.killpg(p.pid, signal.SIGKILL), train_args=train_args)
    # rank 0's own log: the console is fed by tailing it, which a kill -9 cuts short
    shown = next(workdir.glob("phalanx-logs/*/attempt_0/rank0/stdout.log")).read_text()
    assert "step 1140/1140" not in shown, "the run ended before it was killed: make it longer"
    assert re.search(r"epoch 1/20  step 57  loss \d+\.\d+", shown), shown


def test_a_finished_run_can_be_run_again_for_nothing_or_continued_with_more_epochs(workdir):
    """The last step is checkpointed: the same command trains no step again, and a larger
    --epochs continues from there to the parameters of a run that had that many from the start."""
    ck = ("--checkpoint-dir", str(workdir / "ck"))
    first = train(workdir, "first", "--epochs", "2", *ck)
    assert (workdir / "ck" / f"step-{first['steps']:09d}" / "phalanx.json").exists()
    again = train(workdir, "again", "--epochs", "2", *ck)
    assert "the training had finished: nothing is left to train" in again["output"], again["output"]
    assert "no step trained in this run" in again["output"]
    assert (again["resumed_from_step"], again["steps"], again["samples_per_second"]) == (
        first["steps"],
        first["steps"],
        None,
    )
    assert again["params_sha256"] == first["params_sha256"]
    other_batches = run_command(phalanx_argv("run", TRAIN, "--epochs", "2", "--batch-size", "64", *ck), timeout=120,
                                cwd=workdir)  # fmt: skip
    assert other_batches.returncode == 2, other_batches.output
    assert "the checkpoint was saved with a batch size of 32 per process; this run's is 64" in other_batches.stderr
    longer = train(workdir, "longer", "--epochs", "3", *ck)
    from_the_start = train(workdir, "from_the_start", "--epochs", "3")
    assert longer["resumed_from_step"] == first["steps"] and longer["steps"] == from_the_start["steps"]
    assert longer["params_sha256"] == from_the_start["params_sha256"]


def epoch_lines(output: str) -> list[tuple[int, int, str, str]]:
    """(epoch, step, loss as printed, the rest of the line: a note) of each epoch line."""
    pattern = r"epoch (\d+)/\d+  step (\d+)  loss (\S+)(.*)"
    return [(int(e), int(s), loss, note.strip()) for e, s, loss, note in re.findall(pattern, output)]


def test_ranks_that_disagree_are_named_on_every_rank(phalanx, workdir):
    script = workdir / "mismatch.py"
    script.write_text((WORKERS / "mismatch.py").read_text())
    result = phalanx("run", "--nproc-per-node", "2", str(script))
    assert result.returncode == 2, result.output  # ExitCode.REFUSED: the ranks were not started alike
    assert "consistent" not in result.stdout
    cause = result.stderr[result.stderr.index("phalanx: root cause:") :]
    assert "it refused its settings" in cause
    assert re.search(
        r"\n  (refused too|stopped by their agent): rank [01]\n", cause
    )  # the other had refused, or not yet
    assert "phalanx: error: the ranks disagree before the first step\n  " in cause and "Traceback" not in cause
    for rank in (0, 1):
        log = next(workdir.glob(f"phalanx-logs/*/attempt_0/rank{rank}/stderr.log")).read_text()
        assert "InconsistentRanks: phalanx: error: the ranks disagree before the first step" in log
        assert "dataset length: ranks 0: 100; ranks 1: 101" in log
        assert "parameter shapes: ranks 0: ['weight:(2, 4)'" in log


@pytest.mark.compat
@pytest.mark.parametrize("compression", ["fp16", "powersgd"])
def test_compression_modes_train(workdir, compression):
    metrics = train(workdir, compression, "--epochs", "2", "--compression", compression, nproc=2)
    assert metrics["accuracy"] > 0.7 and metrics["world_size"] == 2


@pytest.mark.parametrize("restarts", ["0", "2"])
def test_bf16_on_gloo_is_refused_with_a_hint_and_never_restarted(phalanx, workdir, restarts):
    """With --max-restarts, torchrun alone would start the same refusal twice more."""
    result = phalanx(
        "run", "--nproc-per-node", "2", "--max-restarts", restarts, TRAIN, "--epochs", "1", "--compression", "bf16"
    )
    assert result.returncode == 2, result.output  # ExitCode.REFUSED, as a refusal before the start
    cause = result.stderr[result.stderr.index("phalanx: root cause:") :]  # the message, not the traceback
    assert "phalanx: error: compression bf16 on the gloo backend (cpu)" in cause and "Traceback" not in cause
    assert cause.rstrip().endswith("HINT: use --compression fp16 (same bytes on the wire) or powersgd on gloo")
    assert [path.name for path in workdir.glob("phalanx-logs/*/attempt_*")] == ["attempt_0"]
    # the console names the rank once: phalanx.init took torch's "[rank0]: " prefix off again
    assert "\n[node0 rank0]: Traceback (most recent call last):" in result.stderr and "[rank0]: " not in result.stderr
    not_restarted = f"phalanx: node0: not restarting the workers (--max-restarts {restarts}): rank"
    assert (not_restarted in result.stderr) == (restarts != "0"), result.stderr


def test_uneven_shards_neither_hang_nor_count_padding(workdir):
    # 101 samples over 2 ranks: rank 1 gets one padded sample, yet both take the same steps.
    metrics = train(workdir, "uneven", "--samples", "101", "--batch-size", "8", "--epochs", "2", nproc=2)
    assert metrics["steps"] == 2 * 7  # ceil(51 / 8) steps per epoch on every rank
    single = train(workdir, "uneven1", "--samples", "101", "--batch-size", "8", "--epochs", "1")
    assert single["steps"] == 13


@pytest.mark.compat
def test_a_stalled_rank_is_named_within_the_bound(phalanx, workdir):
    script = workdir / "stall.py"
    script.write_text((WORKERS / "stall.py").read_text())
    timeout = 4
    result = phalanx("run", "--simulate-nodes", "2", "--nproc-per-node", "2", str(script), "2",
                     env={"PHALANX_STALL_TIMEOUT": str(timeout)}, timeout=120)  # fmt: skip
    assert result.returncode == 4, result.output  # ExitCode.STALLED: the root cause's own code
    assert result.seconds < timeout + 30 + 20  # + the launch itself on this 2-core machine
    cause = result.stderr[result.stderr.index("phalanx: root cause:") :]
    assert "exited with code 4" in cause  # ExitCode.STALLED, from the watchdog of a waiting rank
    assert "in collective #4 (gloo:all_reduce)" in cause  # #1 is phalanx.init's barrier
    assert "stalled: rank 2 on node1: never called collective #4; last completed #3 (gloo:all_reduce, step 2)" in cause
    assert "not reached" not in result.stdout


def test_a_stall_in_a_process_group_names_its_member_that_never_called_the_collective(phalanx, workdir):
    """Sequence numbers count per group: rank 1 is 30 collectives along in the default group but
    never called the pair's #3; rank 2, outside the pair, is not named. The sleepers' logs went
    quiet first, but the agent killed them: the report stays the root cause."""
    script = workdir / "stall_in_group.py"
    script.write_text((WORKERS / "stall_in_group.py").read_text())
    result = phalanx("run", "--nproc-per-node", "3", str(script), env={"PHALANX_STALL_TIMEOUT": "4"}, timeout=120)
    assert result.returncode == 4, result.output  # ExitCode.STALLED
    cause = result.stderr[result.stderr.index("phalanx: root cause:") :]
    assert "in collective #3 (gloo:all_reduce) of process group 1 (pair)" in cause
    stalled = [line.strip() for line in cause.splitlines() if line.strip().startswith("stalled:")]
    assert stalled == [
        "stalled: rank 1 on node0: never called collective #3; last completed #2 (gloo:all_reduce, step 30)"
    ]
    assert "stopped by their agent: ranks 1, 2" in cause
    assert "not reached" not in result.stdout


def test_a_watchdog_that_cannot_work_says_so_once_and_the_training_runs(workdir):
    """With the flight recorder switched off the watchdog would never fire: phalanx.init says so
    in each rank's log, of which the console shows rank 0's, and the job trains on without it."""
    result = run_command(phalanx_argv("run", "--nproc-per-node", "2", TRAIN, "--epochs", "1"), timeout=120, cwd=workdir,
                         env={"TORCH_FR_BUFFER_SIZE": "0"})  # fmt: skip
    assert result.returncode == 0, result.output
    assert result.output.count("phalanx: the stall watchdog is off: TORCH_FR_BUFFER_SIZE=0") == 1, result.output
    assert "final: loss" in result.output


@pytest.mark.compat
def test_sigusr1_to_the_workers_ends_the_launch_with_the_preemption_code(workdir):
    def preempt_workers(process: subprocess.Popen) -> None:  # as SLURM's --signal=USR1 does
        for worker in psutil.Process(process.pid).children(recursive=True):
            if TRAIN in " ".join(worker.cmdline()):
                worker.send_signal(signal.SIGUSR1)

    code, output, out = interrupt_after_first_checkpoint(workdir, preempt_workers)
    assert code == 75, output
    assert re.search(r"preempted by SIGUSR1 after step \d+; checkpoint saved", output), output
    assert "stopped for preemption after saving a checkpoint; run the same command again" in output
    assert "root cause" not in output and not out.exists()


def test_workers_stopped_for_preemption_are_not_restarted(phalanx, workdir):
    """Under --max-restarts torchrun alone restarts them: they resume and train to the end (exit
    0) on a machine that is being taken away, instead of exit 75 for a relaunch."""
    worker = WORKERS / "signal_at_step.py"  # both ranks: SIGTERM after step 5
    result = phalanx("run", "--nproc-per-node", "2", "--max-restarts", "2", str(worker), "TERM", "all", "5", "--samples", "448",
                     "--batch-size", "16", "--epochs", "1", "--checkpoint-dir", "ck", "--metrics-json", "metrics.json")  # fmt: skip
    assert result.returncode == 75, result.output
    assert "phalanx: node0: not restarting the workers (--max-restarts 2): they stopped for preemption" in result.stderr
    assert [path.name for path in workdir.glob("phalanx-logs/*/attempt_*")] == ["attempt_0"]
    assert not (workdir / "metrics.json").exists()  # the training did not finish


@pytest.mark.parametrize("signal_step", [27, 28])
def test_a_preemption_after_the_last_step_finishes_the_run(workdir, signal_step):
    """28 steps in all (448 samples, batch 16). A stop asked for after step 27 saves and exits
    75 for a relaunch; after step 28 there is nothing left to train, so the run finishes as an
    uninterrupted one does: exit 0, its checkpoint, its final metrics."""
    worker = WORKERS / "signal_at_step.py"
    out = workdir / "metrics.json"
    argv = [sys.executable, str(worker), "TERM", "all", str(signal_step), "--samples", "448", "--batch-size", "16", "--epochs", "1",
            "--checkpoint-dir", str(workdir / "ck"), "--metrics-json", str(out)]  # fmt: skip
    result = run_command(argv, timeout=120, cwd=workdir)
    assert (workdir / "ck" / f"step-{signal_step:09d}" / "phalanx.json").exists(), result.output
    if signal_step < 28:
        assert result.returncode == 75, result.output
        assert f"preempted by SIGTERM after step {signal_step}; checkpoint saved" in result.output
        assert not out.exists()
        return
    assert result.returncode == 0, result.output
    assert "SIGTERM came after the last step: the training is complete" in result.output
    assert "preempted by" not in result.output
    assert json.loads(out.read_text())["steps"] == 28


def test_preemption_votes_are_rare_on_short_steps_ride_on_logging_points_and_every_rank_stops_after_the_same_step(
    workdir,
):
    """Until step 200 a logging point every 10 steps carries the vote: the guard issues no
    collective of its own there (but for its first vote) and the logged means are right. After it,
    the guard votes in collectives of its own about every period (0.3 s here), not at every
    boundary, and a signal on one rank still stops every rank after one and the same step, soon
    after it arrived."""
    worker = WORKERS / "preemption_votes.py"
    signal_step, period_s, log_every, log_until = 300, 0.3, 10, 200
    argv = ("run", "--nproc-per-node", "2", str(worker), str(workdir), "1", str(signal_step), str(period_s),
            str(log_every), str(log_until))  # fmt: skip
    result = run_command(phalanx_argv(*argv), timeout=120, cwd=workdir)
    assert result.returncode == 0, result.output
    lines = [json.loads((workdir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    stops = {line["stopped_after"] for line in lines}
    assert len(stops) == 1, lines  # the same step on every rank
    (stopped_after,) = stops
    for line in lines:
        assert line["means"] == [1.5] * (log_until // log_every), line  # ranks 0 and 1 add 1 and 2
        assert line["own_votes_while_logging"] <= 1, line  # the first vote comes before the first logging point
        assert line["votes"] >= log_until // log_every, line
        # A step takes at least 2 ms: a vote every 0.3 s is at most one per 150 steps.
        assert line["own_votes"] <= stopped_after / 20, line
    # The signal is read within two votes and one boundary.
    assert signal_step < stopped_after <= signal_step + 2 * period_s / 0.002 + 1, lines


def test_heal_mode_says_whether_the_launcher_restarts_what_it_cannot_heal(phalanx, workdir):
    # a script that fails before its phalanx.Run armed healing is left to the launcher: its
    # restart while --max-restarts has one left, else the job's end
    script = workdir / "fails_at_once.py"
    script.write_text("raise RuntimeError('fails before any training')\n")
    done = phalanx("run", "--heal", "1", "--max-restarts", "1", str(script))
    assert done.returncode == 1, done.output
    before = "[node0 rank0]: phalanx: the script failed (exit code 1) before its phalanx.Run could heal"
    first, last = [line for line in done.stderr.splitlines() if line.startswith(before)]
    assert first.endswith("leaving it to the launcher (1 of --max-restarts 1 left on this node)"), first
    assert last.endswith("leaving it to the launcher, which has no restart left on this node (--max-restarts 1)"), last


def test_a_rank_that_ended_early_is_named_before_the_failure_it_caused(phalanx, workdir):
    # rank 0 leaves the loop after 3 steps and exits 0; rank 1's next all-reduce loses its peer
    script = workdir / "leaves_early.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "value = torch.ones(1)\n"
        "for step in range(1000):\n"
        "    if dist.get_rank() == 0 and step == 3:\n"
        "        break\n"
        "    dist.all_reduce(value)\n"
    )
    done = phalanx("run", "--nproc-per-node", "2", str(script))
    assert done.returncode == 1, done.output
    cause = done.stderr[done.stderr.index("phalanx: root cause:") :]
    assert cause.startswith("phalanx: root cause: rank 1 "), cause
    assert "\n  before it, rank 0 had ended on its own while the others trained on" in cause, cause
    assert "HINT: where a rank leaves the training before the others" in cause, cause


def test_a_step_with_no_forward_through_ddp_s_wrapper_is_named_once(phalanx, workdir):
    # the first epoch calls the model setup_model returned; the second the module given to it,
    # whose gradients DDP never averages: the warning names step 5, the second epoch's first
    script = workdir / "inner_module.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "import phalanx\n"
        "run = phalanx.Run(log_every=100)\n"
        "inner = torch.nn.Linear(2, 1)\n"
        "model = run.setup_model(inner)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = run.setup_dataloader(TensorDataset(torch.randn(16, 2)), batch_size=2)\n"
        "for epoch in run.epochs(2):\n"
        "    forward = model if epoch == 0 else inner\n"
        "    for (x,) in loader:\n"
        "        loss = forward(x).pow(2).mean()\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
        "        run.step(loss)\n"
        "run.close()\n"
    )
    done = phalanx("run", "--nproc-per-node", "2", str(script))
    assert done.returncode == 0, done.output
    warned = [line for line in done.output.splitlines() if "had no forward pass through the model" in line]
    assert len(warned) == 1 and "WARNING: step 5 had no forward pass" in warned[0], done.output


def test_plain_torchrun_with_phalanx_s_log_layout_shows_what_torch_s_would(workdir):
    # torchrun's defaults (no --redirects, no --tee) print every rank to the console, as torch's
    # own layout does; with --redirects 3 --tee 3, every rank is in its folder and rank 0 is shown
    script = workdir / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'], flush=True)\n")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--logs-specs", "phalanx", "--nproc-per-node", "2"]
    plain = run_command([*torchrun, "--log-dir", "plain", str(script)], timeout=120, cwd=workdir)
    assert plain.returncode == 0, plain.output
    assert {"hello from 0", "hello from 1"} <= set(plain.stdout.splitlines()), plain.output
    logged = run_command([*torchrun, "--redirects", "3", "--tee", "3", "--log-dir", "logged", str(script)],
                         timeout=120, cwd=workdir)  # fmt: skip
    assert logged.returncode == 0, logged.output
    assert "hello from 0" in logged.stdout and "hello from 1" not in logged.stdout, logged.output
    for rank in (0, 1):
        assert (workdir / f"logged/attempt_0/rank{rank}/stdout.log").read_text() == f"hello from {rank}\n"


def test_runs_one_after_another_in_the_same_processes_form_their_groups(phalanx, workdir):
    # each Run's process group formed on the keys the one before left in the launcher's store:
    # a rank read its peer's old address and the peer waited forever (most of these runs hung)
    script = workdir / "runs_in_a_row.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "import phalanx\n"
        "for generation in range(4):\n"
        "    context = phalanx.init(timeout=20)\n"
        "    run = phalanx.Run(context=context, log_every=100)\n"
        "    model = run.setup_model(torch.nn.Linear(8, 2))\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    loader = run.setup_dataloader(TensorDataset(torch.randn(32, 8)), batch_size=8)\n"
        "    for _ in run.epochs(1):\n"
        "        for (x,) in loader:\n"
        "            model(x).sum().backward()\n"
        "            optimizer.step()\n"
        "            optimizer.zero_grad()\n"
        "            run.step()\n"
        "    run.close()\n"
        "    context.close()\n"
        "    print('generation', generation, 'trained', run.global_step, 'steps', flush=True)\n"
    )
    done = phalanx("run", "--nproc-per-node", "2", str(script), timeout=150)
    assert done.returncode == 0, done.output
    assert [f"generation {n} trained 2 steps" in done.output for n in range(4)] == [True] * 4, done.output


def test_a_script_that_reaps_all_its_children_is_not_kept_waiting(phalanx, workdir):
    # the group guard is no child of the worker: os.wait() until none is left ends as under torchrun
    script = workdir / "reaps.py"
    script.write_text(
        "import os, time\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(0.2)\n"
        "        os._exit(0)\n"
        "reaped = 0\n"
        "while True:\n"
        "    try:\n"
        "        os.wait()\n"
        "    except ChildProcessError:\n"
        "        break\n"
        "    reaped += 1\n"
        "print('reaped', reaped, flush=True)\n"
    )
    done = phalanx("run", "--nproc-per-node", "2", "--independent-ranks", str(script), timeout=60)
    assert done.returncode == 0 and "reaped 2" in done.output, done.output


def test_the_script_stays_main_for_its_exit_handlers_and_threads(phalanx, workdir):
    # a checkpoint pickled at exit, or by a thread that outlives the script body, names classes of
    # the script as __main__.NAME: under runpy they were gone once the body returned
    script = workdir / "saves_at_exit.py"
    script.write_text(
        "import atexit, dataclasses, os, pickle, threading, time\n"
        "@dataclasses.dataclass\n"
        "class Config:\n"
        "    lr: float = 0.1\n"
        "def save(name):\n"
        "    saved = pickle.dumps(Config())  # the file is written only once this worked\n"
        "    with open(f'{name}-{os.environ[\"RANK\"]}.pkl', 'wb') as out:\n"
        "        out.write(saved)\n"
        "atexit.register(save, 'at-exit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), save('thread'))).start()\n"
    )
    done = phalanx("run", "--nproc-per-node", "2", "--independent-ranks", str(script))
    assert done.returncode == 0, done.output
    saved = sorted(path.name for path in workdir.glob("*.pkl"))
    assert saved == ["at-exit-0.pkl", "at-exit-1.pkl", "thread-0.pkl", "thread-1.pkl"], done.output


def test_a_script_that_changes_its_working_folder_is_reported_by_its_own_error(phalanx, workdir):
    # as Hydra does: the worker's error file and records are written after the chdir
    (workdir / "outputs").mkdir()
    script = workdir / "changes_folder.py"
    script.write_text(
        "import os\n"
        "os.chdir('outputs')\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('the loss is NaN at step 7')\n"
    )
    done = phalanx("run", "--nproc-per-node", "2", "--independent-ranks", str(script))
    assert done.returncode == 1, done.output
    cause = done.stderr[done.stderr.index("phalanx: root cause:") :]
    assert "RuntimeError: the loss is NaN at step 7" in cause and "FileNotFoundError" not in done.output, cause


def test_a_traceback_after_init_process_group_has_one_prefix(phalanx, workdir):
    # torch's excepthook adds "[rank0]: " to every line; the console names the node and rank already
    script = workdir / "raises.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\nraise ValueError('boom')\n")
    done = phalanx("run", "--nproc-per-node", "2", str(script))
    assert done.returncode == 1 and "[node0 rank0]: ValueError: boom" in done.output, done.output
    assert "[rank0]:" not in done.output and "[rank1]:" not in done.output, done.output
