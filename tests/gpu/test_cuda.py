"""What CI cannot run: it has no GPU. Every test here skips without CUDA.

On a machine with one: ``bash tests/gpu/device_check.sh``. With a single GPU, NCCL groups have
one rank (NCCL refuses two ranks on one device), so what needs two GPUs (phalanx.init's barrier
with device_ids, an all-reduce that sums across ranks) is not checked here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import phalanx
from tests.conftest import EXAMPLES, phalanx_argv, run_command

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def context(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "PHALANX_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    context = phalanx.init()
    yield context
    context.close()


def test_init_takes_the_gpu_and_nccl(context):
    assert (context.device, context.backend, context.world_size) == (torch.device("cuda", 0), "nccl", 1)


def test_global_mean_sums_gpu_values_on_the_device(context):
    totals = phalanx.GlobalMean(context, "loss")
    losses = [0.5, 1.25, 3.0, 0.125]
    for samples, loss in enumerate(losses, start=1):
        totals.add_mean(samples, loss=torch.tensor(loss, device=context.device))
    result = totals.compute()
    # the values were kept and summed on the GPU (no sync before a collective), not read one by one
    assert totals._device_sums is not None and totals._device_sums.device.type == "cuda"
    assert result["samples"] == 10
    assert result["loss"] == pytest.approx(sum(n * loss for n, loss in enumerate(losses, start=1)) / 10, rel=1e-12)


def test_bf16_autocast_and_fp16_loss_scaling(context):
    layer = torch.nn.Linear(16, 4).to(context.device)
    data = torch.randn(8, 16, device=context.device)
    bf16 = phalanx.MixedPrecision("bf16", context.device)
    with bf16.autocast():
        assert layer(data).dtype == torch.bfloat16
    fp16 = phalanx.MixedPrecision("fp16", context.device)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = layer.weight.detach().clone()
    with fp16.autocast():
        loss = layer(data).float().pow(2).mean()
    fp16.backward(loss)
    fp16.step(optimizer)
    assert not torch.equal(before, layer.weight), "the scaled step did not reach the parameters"


def test_an_nccl_group_of_one_rank_with_each_compression_and_the_flight_recorder(tmp_path):
    script = Path(__file__).with_name("nccl_group_of_one.py")
    result = run_command([sys.executable, str(script), str(tmp_path / "store")], timeout=180, cwd=tmp_path)
    print(result.output)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("ok"), result.output


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_example_trains_on_the_gpu_under_the_launcher(tmp_path, precision):
    """One process (one GPU): no process group. fp16 is refused on a CPU, so it proves the GPU."""
    out = tmp_path / "metrics.json"
    command = phalanx_argv("run", "--nproc-per-node", "1", str(EXAMPLES / "train.py"), "--epochs", "3",
                           "--precision", precision, "--metrics-json", str(out))  # fmt: skip
    result = run_command(command, timeout=300, cwd=tmp_path)
    print(result.output)
    assert result.returncode == 0, result.output
    assert "backend    nccl (auto" in result.output  # the launcher's decision block: the backend it chose
    metrics = json.loads(out.read_text())
    assert metrics["accuracy"] > 0.8, metrics
