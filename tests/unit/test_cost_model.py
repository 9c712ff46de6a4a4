"""The ring model behind `phalanx plan`: hand-computed figures, torch's own bucket and PowerSGD counts,
unit parsing, and the command's refusals and JSON."""

from __future__ import annotations

import json
import sys

import pytest

from phalanx.bench.cost_model import (
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    Layout,
    RingBound,
    ddp_bucket_count,
    powersgd_elements,
    predict,
    ring_allreduce_seconds,
    ring_bound,
    traffic,
)
from phalanx.bench.link import DoctorLink, Link, parse_bandwidth, parse_latency, read_doctor_file
from phalanx.bench.model_size import ModelSize, parse_param_count, size_from_model
from phalanx.errors import SettingsRefused
from phalanx.settings.values import InvalidValue
from tests.conftest import phalanx_argv, run_command

GIGABIT = Link(125e6, 50e-6, "test", "test")
TUTORIAL_SHAPES = ((10, 150528), (10,))  # the tutorial's nn.Linear(3*224*224, 10): weight, bias
TUTORIAL = ModelSize(1_505_290, TUTORIAL_SHAPES, "test")


def count(parameters: int) -> ModelSize:
    return ModelSize(parameters, None, "test")


def network_bound(link: Link = GIGABIT) -> RingBound:
    return RingBound(link, "test")


# --- the formula, by hand -------------------------------------------------------------------


def test_two_ranks_one_gigabit_100_megabytes_take_0_8_seconds_plus_latency():
    # 2(n-1)/n x 100 MB / 125 MB/s = 1 x 0.8 s; one all-reduce adds 2(n-1) x 50 us.
    assert ring_allreduce_seconds(100e6, 2, GIGABIT) == pytest.approx(0.8 + 2 * 50e-6, rel=1e-12)
    assert ring_allreduce_seconds(100e6, 2, Link(125e6, 0.0, "t", "t")) == pytest.approx(0.8, rel=1e-12)


def test_eight_ranks_send_seven_quarters_of_the_payload():
    link = Link(1.25e9, 10e-6, "t", "t")  # 10 Gbit/s
    expected = 2 * 7 / 8 * 400e6 / 1.25e9 + 3 * 2 * 7 * 10e-6
    assert ring_allreduce_seconds(400e6, 8, link, allreduces=3) == pytest.approx(expected, rel=1e-12)


def test_25m_parameters_on_2_nodes_over_1_gbit_predict_800_ms_plus_five_buckets_of_latency():
    prediction = predict(count(25_000_000), Layout(2, 1), network_bound())
    none, fp16, bf16, powersgd = prediction.rows
    # 100 MB of fp32 gradients: DDP's 1 MiB first bucket, then ceil((100e6 - 1 MiB) / 25 MiB) = 4 more.
    assert none.traffic.bytes == 100_000_000 and none.traffic.allreduces == 5
    assert none.seconds == pytest.approx(0.8 + 5 * 2 * 1 * 50e-6, rel=1e-12)
    assert none.traffic.sent_per_rank(2) == 100_000_000  # 2(n-1)/n = 1 for two ranks
    assert fp16.traffic.bytes == bf16.traffic.bytes == 50_000_000 and fp16.ratio == 2.0
    assert fp16.seconds == pytest.approx(0.4 + 5 * 2 * 50e-6, rel=1e-12)
    assert powersgd.traffic is None and powersgd.seconds is None and "--model" in powersgd.note
    assert [row.compression for row in prediction.fastest] == ["fp16", "bf16"]


def test_one_rank_has_no_network_time_whatever_the_link():
    assert ring_allreduce_seconds(1e12, 1, GIGABIT, allreduces=100) == 0.0
    prediction = predict(TUTORIAL, Layout(1, 1), None)
    assert [row.seconds for row in prediction.rows] == [0.0, 0.0, 0.0, 0.0]
    assert prediction.rows[0].traffic.sent_per_rank(1) == 0


def test_fp16_and_bf16_halve_the_bytes_but_not_the_all_reduces():
    for parameters in (1, 7, 1_000_003, 10**9):
        none, fp16, bf16 = (traffic(name, count(parameters)) for name in ("none", "fp16", "bf16"))
        assert fp16.bytes * 2 == bf16.bytes * 2 == none.bytes == parameters * 4
        assert fp16.allreduces == none.allreduces


def test_bucket_count_follows_ddp_caps():
    assert ddp_bucket_count(count(1)) == 1
    assert ddp_bucket_count(count(DDP_FIRST_BUCKET_BYTES // 4)) == 1
    assert ddp_bucket_count(count(DDP_FIRST_BUCKET_BYTES // 4 + 1)) == 2
    assert ddp_bucket_count(count((DDP_FIRST_BUCKET_BYTES + 2 * DDP_BUCKET_BYTES) // 4)) == 3
    # With shapes: a parameter bigger than the cap closes its bucket alone.
    huge = ModelSize(3 * 2**24, ((2**24,), (2**24,), (2**24,)), "t")  # three 64 MiB tensors
    assert ddp_bucket_count(huge) == 3


# --- PowerSGD, by torch's rule ----------------------------------------------------------------


def test_powersgd_on_the_tutorial_linear_sends_p_and_q_plus_the_bias():
    for rank in (1, 4):
        sent = traffic("powersgd", TUTORIAL, powersgd_rank=rank)
        assert sent.bytes == (150528 + 10) * rank * 4 + 10 * 4
        assert (sent.compressed_tensors, sent.tensors) == (1, 2)
        assert sent.allreduces == 3  # one bucket: uncompressed tensors, P, Q
    prediction = predict(TUTORIAL, Layout(2, 1), network_bound())
    none, powersgd = prediction.rows[0], prediction.rows[3]
    assert powersgd.ratio == pytest.approx(1_505_290 / (150538 + 10), rel=1e-12)
    assert powersgd.seconds == pytest.approx(602_192 / 125e6 + 3 * 2 * 50e-6, rel=1e-12)
    assert prediction.fastest == [powersgd] and powersgd.speedup == pytest.approx(none.seconds / powersgd.seconds)


@pytest.mark.parametrize(
    "shape, rank, expected",
    [
        ((10,), 1, (10, False)),  # a bias: 10 x 1, (10 + 1) x 1 x 2 > 10
        ((64, 3, 3, 3), 1, (64 + 27, True)),  # a conv weight viewed as 64 x 27
        ((3, 2), 4, (6, False)),  # rank clipped to 2: (3 + 2) x 2 x 2 > 6
        ((100, 100), 25, (10000, False)),  # (200) x 25 x 2 = 10000, not less: sent whole
        ((100, 100), 24, (200 * 24, True)),
        ((), 1, (1, False)),  # a scalar parameter
    ],
)
def test_powersgd_compresses_only_when_it_halves_the_tensor(shape, rank, expected):
    assert powersgd_elements(shape, rank) == expected


AGREEMENT_SCRIPT = r"""
import json, os, sys
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from phalanx.bench.cost_model import ddp_bucket_count, traffic
from phalanx.bench.model_size import ModelSize

dist.init_process_group("gloo", init_method="file://" + os.path.abspath("store"), rank=0, world_size=1)  # in the test's tmp_path
models = {
    "tutorial": (nn.Linear(150528, 10), (2, 150528)),
    "mlp": (nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)]), (2, 1024)),
    # Linear(8, 8) at rank 2 sends P and Q only if min_compression_rate were 1: (8 + 8) x 2 x 2 = 64, not < 64.
    "uneven": (nn.Sequential(nn.Linear(4096, 2048), nn.Linear(2048, 64), nn.LayerNorm(64), nn.Linear(64, 8), nn.Linear(8, 8)),
               (2, 4096)),
}
report = {}
for name, (model, input_shape) in models.items():
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    size = ModelSize(sum(p.numel() for p in model.parameters()), shapes, name)
    plain = nn.parallel.DistributedDataParallel(model)
    for _ in range(3):  # DDP rebuilds its buckets at the second step, from the order gradients arrived in
        plain(torch.randn(*input_shape)).sum().backward()
    buckets = plain._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")
    # One bucket for PowerSGD: on gloo, torch's hook can deadlock with several buckets in flight
    # (its callbacks wait on new all-reduces inside gloo's worker threads). Counts are per tensor anyway.
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=10_000)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    counted = []
    for _ in range(4):  # steps 0 and 1 are plain all-reduces; 2 and 3 compress
        ddp(torch.randn(*input_shape)).sum().backward()
        counted.append(state.total_numel_after_compression)
    report[name] = {
        "torch_elements_per_step": counted[3] - counted[2],
        "model_elements": traffic("powersgd", size, powersgd_rank=2).bytes // 4,
        "torch_buckets": len(buckets),
        "model_buckets": ddp_bucket_count(size),
    }
print(json.dumps(report), flush=True)
os._exit(0)  # no teardown: torch's hook on gloo can abort it (tests/unit/powersgd_layout_checks.py says why)
"""


def test_powersgd_elements_and_ddp_buckets_match_what_torch_does(tmp_path):
    # A real DDP (one gloo process) with torch's own PowerSGD hook: its counter of elements sent
    # and the buckets DDP rebuilds after the first step are the figures the model predicts.
    script = tmp_path / "agreement.py"
    script.write_text(AGREEMENT_SCRIPT)
    result = run_command([sys.executable, str(script)], timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for name, figures in report.items():
        assert figures["model_elements"] == figures["torch_elements_per_step"], name
        assert figures["model_buckets"] == figures["torch_buckets"], name
    assert report["mlp"]["torch_buckets"] > 1  # the bucket rule is exercised, not only the one-bucket case


# --- which link bounds the ring ---------------------------------------------------------------


def test_several_nodes_are_bound_by_the_network_unless_the_node_is_slower():
    network = Link(125e6, 50e-6, "--bandwidth", "default")
    fast_node = Link(100e9, 1e-6, "--intra-bandwidth", "x")
    slow_node = Link(50e6, 1e-6, "--intra-bandwidth", "x")
    assert ring_bound(Layout(2, 4), network, fast_node).link == network
    slow = ring_bound(Layout(2, 4), network, slow_node).link
    assert (slow.bandwidth_bytes_per_s, slow.latency_s) == (50e6, 50e-6)
    assert ring_bound(Layout(1, 8), None, None) is None
    assert ring_bound(Layout(1, 8), None, fast_node).link == fast_node


# --- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, bytes_per_s",
    [
        ("1gbit", 125e6),
        ("10Gbit/s", 1.25e9),
        ("25gbps", 3.125e9),
        ("12.5GB/s", 12.5e9),
        ("100 MB/s", 100e6),
        ("1000mbit", 125e6),
        ("1GiB/s", 2.0**30),
        ("400 Gbits/s", 50e9),
        ("2e9 bytes/s", 2e9),
    ],
)
def test_bandwidth_units(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s, rel=1e-12)


@pytest.mark.parametrize(
    "text, says",
    [
        ("10Gb", "leaves open whether bits or bytes"),
        ("10GBps", "leaves open"),
        ("10gb/s", "leaves open"),
        ("10", "leaves open"),
        ("10 furlongs", "not a unit of bandwidth"),
        ("0gbit", "more than zero"),
        ("-1gbit", "not a bandwidth"),
        ("fast", "not a bandwidth"),
    ],
)
def test_ambiguous_or_wrong_bandwidth_is_refused_with_both_spellings(text, says):
    with pytest.raises(InvalidValue) as refused:
        parse_bandwidth(text)
    assert says in refused.value.why
    assert "10gbit" in refused.value.hint and "GB/s" in refused.value.hint


@pytest.mark.parametrize(
    "text, seconds", [("50us", 50e-6), ("50µs", 50e-6), ("0.2ms", 2e-4), ("2e-5s", 2e-5), ("0", 0.0)]
)
def test_latency_units(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("text, says", [("50", "no unit"), ("fast", "not a time"), ("-1us", "not a time")])
def test_latency_without_a_unit_is_refused(text, says):
    with pytest.raises(InvalidValue) as refused:
        parse_latency(text)
    assert says in refused.value.why and "50us" in refused.value.hint


@pytest.mark.parametrize(
    "text, parameters",
    [("25M", 25_000_000), ("1.3B", 1_300_000_000), ("124439808", 124439808), ("124_439_808", 124439808),
     ("124,439,808", 124439808), ("7k", 7000), ("1e6", 10**6), ("0.5K", 500)],
)  # fmt: skip
def test_parameter_counts(text, parameters):
    assert parse_param_count(text) == parameters


@pytest.mark.parametrize(
    "text, says",
    [("25MB", "a size in bytes"), ("1.5", "not a whole number"), ("abc", "not a parameter count"), ("0", "at least 1"),
     ("1e30", "more than")],
)  # fmt: skip
def test_parameter_counts_refused(text, says):
    with pytest.raises(InvalidValue) as refused:
        parse_param_count(text)
    assert says in refused.value.why


def test_a_byte_size_suggests_the_parameter_count():
    with pytest.raises(InvalidValue) as refused:
        parse_param_count("100MB")
    assert "--params 25M" in refused.value.hint


# --- the doctor file and --model --------------------------------------------------------------


def test_doctor_file_gives_bandwidth_and_latency(tmp_path):
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps({"network": {"bandwidth_bytes_per_s": 117e6, "latency_s": 8.5e-5}, "nodes": []}))
    assert read_doctor_file(path) == DoctorLink(117e6, 8.5e-5, loopback=False)


def test_a_doctor_file_from_simulated_nodes_is_planned_with_a_caution(tmp_path):
    """doctor marks a run on simulated nodes ("simulated": true): plan says that loopback is no network."""
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps({"simulated": True, "network": {"bandwidth_bytes_per_s": 5.2e9, "latency_s": 2e-5}}))
    assert read_doctor_file(path).loopback
    done = run_command(phalanx_argv("plan", "--params", "25M", "--nnodes", "8", "--from-doctor", str(path)), timeout=60,
                       cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.output
    assert "CAUTION: " + str(path) + " was measured by `phalanx doctor` on simulated nodes" in done.stderr, done.stderr
    assert (
        "its 41.6 Gbit/s = 5.2 GB/s is loopback" in done.stderr
        and "8 real nodes" in done.stderr
        and "HINT: run `phalanx doctor --json`" in done.stderr
    )
    assert "on simulated nodes: loopback" in " ".join(done.stdout.split()), done.stdout


@pytest.mark.parametrize(
    "content, says",
    [
        ({"network": {"latency_s": 1e-5}}, "no number at network.bandwidth_bytes_per_s"),
        ({"network": {"bandwidth_bytes_per_s": 1e9}}, "no number at network.latency_s"),
        ({"network": None}, "no number at network.bandwidth_bytes_per_s"),
        ({"network": {"bandwidth_bytes_per_s": 0, "latency_s": 0}}, "which no link can have"),
        ([1, 2], "no number at network.bandwidth_bytes_per_s"),
    ],
)
def test_doctor_file_without_the_figures_is_refused(tmp_path, content, says):
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps(content))
    with pytest.raises(SettingsRefused) as refused:
        read_doctor_file(path)
    assert says in refused.value.what and "phalanx doctor --json" in refused.value.hint


MODELS_MODULE = """
import torch
import torch.nn as nn


class SimpleModel(nn.Module):  # the tutorial's model
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 224 * 224, 10)


def frozen_embedding():
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 8))
    model[0].weight.requires_grad_(False)
    return model


def needs_real_tensors():
    # .tolist() cannot run on the meta device: the loader must build it for real.
    model = nn.Linear(4, 3)
    assert model.weight.sum().tolist() is not None
    return model


instance = nn.Linear(5, 5)
number = 3


def needs_an_argument(width):
    return nn.Linear(width, width)
"""


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    (tmp_path / "planmodels.py").write_text(MODELS_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("planmodels", None)


def test_model_factory_class_instance_and_frozen_parameters(models_dir):
    tutorial = size_from_model("planmodels:SimpleModel")
    assert tutorial.parameters == 1_505_290 and tutorial.shapes == TUTORIAL_SHAPES
    frozen = size_from_model("planmodels:frozen_embedding")
    assert (frozen.parameters, frozen.frozen, frozen.shapes) == (64 * 8 + 8, 64000, ((8, 64), (8,)))
    assert size_from_model("planmodels:needs_real_tensors").parameters == 15
    assert size_from_model("planmodels:instance").shapes == ((5, 5), (5,))


@pytest.mark.parametrize(
    "path, says",
    [
        ("planmodels", "not an import path with a ':'"),
        ("no_such_module_xyz:build", "importing no_such_module_xyz failed"),
        ("planmodels:missing", "has no attribute 'missing'"),
        ("planmodels:number", "neither an nn.Module nor callable"),
        ("planmodels:needs_an_argument", "calling it without arguments failed"),
    ],
)
def test_model_paths_refused(models_dir, path, says):
    with pytest.raises(SettingsRefused) as refused:
        size_from_model(path)
    assert says in refused.value.what and refused.value.hint


# --- the command ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--params", "lots", "--nnodes", "2", "--bandwidth", "1gbit"], "is not a parameter count"),
        (
            ["--model", "no_such_module_xyz:build", "--nnodes", "2", "--bandwidth", "1gbit"],
            "importing no_such_module_xyz",
        ),
        (["--params", "25M", "--nnodes", "2"], "needs the network's bandwidth"),
        (["--params", "25M", "--nnodes", "2", "--bandwidth", "10Gb"], "leaves open whether bits or bytes"),
        (["--params", "25M", "--nnodes", "2", "--from-doctor", "DOCTOR"], "no number at network.latency_s"),
        (["--params", "25M", "--nnodes", "2", "--from-doctor", "missing.json"], "does not exist"),
        (["--params", "25M", "--nnodes", "1:4", "--bandwidth", "1gbit"], "an elastic job's size changes"),
        (["--params", "25M", "--bandwidth", "1gbit"], "with --nnodes 1"),
        (["--params", "25M", "--model", "x:y"], "--params and --model both given"),
        (["--nnodes", "2", "--bandwidth", "1gbit"], "give the model's size"),
        (["--params", "25M", "--nproc-per-node", "auto"], "--nproc-per-node takes a whole number"),
        (["--params", "25M", "--powersgd-rank", "0"], "--powersgd-rank must be at least 1"),
    ],
)
def test_plan_refusals_exit_2_with_a_hint(phalanx, workdir, argv, says):
    (workdir / "DOCTOR").write_text(json.dumps({"network": {"bandwidth_bytes_per_s": 1e9}}))
    result = phalanx("plan", *argv, timeout=60)
    assert result.returncode == 2, result.output
    assert result.stderr.startswith("phalanx: error: ") and says in result.stderr
    assert "\nHINT: " in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_text_shows_the_tutorial_table_formula_and_verdict(phalanx):
    result = phalanx(
        "plan", "--params", "25M", "--nnodes", "2", "--nproc-per-node", "4", "--bandwidth", "1gbit", timeout=60
    )
    assert result.returncode == 0, result.output
    out = result.stdout
    assert "phalanx: rank table: 2 nodes x 4 processes = world size 8" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  0 ") or line.startswith("  1 ")]
    assert [row[-2:] for row in rows] == [["0-3", "0-3"], ["4-7", "0-3"]]  # RANK, LOCAL_RANK as the tutorial
    assert "t = 2(n-1)/n x S / B + k x 2(n-1) x L" in out
    assert "needs the model's shapes (--model)" in out
    assert "verdict: predicted fastest: fp16 = bf16" in out and "caution:" in out and "overlaps" in out
    none_row = next(line for line in out.splitlines() if line.strip().startswith("none"))
    # 2 x 7/8 x 100 MB / 125 MB/s = 1400 ms, plus 5 buckets x 2 x 7 x 50 us = 3.5 ms
    assert "1,403.5" in none_row and "175.0" in none_row


def test_plan_json_from_a_module_and_a_doctor_file(phalanx, workdir):
    (workdir / "planmodels.py").write_text(MODELS_MODULE)
    doctor = workdir / "doctor.json"
    doctor.write_text(json.dumps({"network": {"bandwidth_bytes_per_s": 125e6, "latency_s": 1e-4}}))
    argv = ["plan", "--model", "planmodels:SimpleModel", "--nnodes", "2", "--from-doctor", str(doctor), "--json"]
    result = phalanx(*argv, timeout=120)
    assert result.returncode == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"] == {"parameters": 1_505_290, "frozen_parameters": 0, "shapes_known": True,
                               "origin": "--model planmodels:SimpleModel"}  # fmt: skip
    assert report["link"]["bandwidth_bytes_per_s"] == 125e6 and report["link"]["latency_s"] == 1e-4
    assert [row["ranks"] for row in report["rank_table"]] == [[0], [1]]
    rows = {row["compression"]: row for row in report["compressions"]}
    assert rows["none"]["bytes_per_step"] == 1_505_290 * 4
    assert rows["none"]["allreduce_s"] == pytest.approx(1_505_290 * 4 / 125e6 + 2 * 1e-4, rel=1e-12)
    assert rows["powersgd"]["bytes_per_step"] == (150528 + 10) * 4 + 40
    assert rows["powersgd"]["allreduces_per_step"] == 3
    assert rows["powersgd"]["allreduce_s"] == pytest.approx(602_192 / 125e6 + 3 * 2 * 1e-4, rel=1e-12)
    assert report["fastest"] == ["powersgd"]
    # --latency overrides the measured latency; the bandwidth stays the measured one.
    overridden = json.loads(phalanx(*argv, "--latency", "0", timeout=120).stdout)
    assert overridden["link"]["latency_s"] == 0.0
    assert overridden["compressions"][0]["allreduce_s"] == pytest.approx(1_505_290 * 4 / 125e6, rel=1e-12)


def test_one_node_needs_the_intra_node_bandwidth_to_predict(phalanx):
    unknown = phalanx("plan", "--params", "25M", "--nproc-per-node", "8", "--json", timeout=60)
    assert unknown.returncode == 0, unknown.output
    report = json.loads(unknown.stdout)
    assert report["link"] is None and all(row["allreduce_s"] is None for row in report["compressions"])
    assert "--intra-bandwidth" in report["verdict"]
    known = json.loads(phalanx("plan", "--params", "25M", "--nproc-per-node", "8", "--intra-bandwidth", "100GB/s",
                               "--json", timeout=60).stdout)  # fmt: skip
    none = known["compressions"][0]
    assert none["allreduce_s"] == pytest.approx(2 * 7 / 8 * 100e6 / 100e9 + 5 * 2 * 7 * 10e-6, rel=1e-12)


def test_plan_help_and_a_count_do_not_import_torch(tmp_path):
    outputs = []
    for argv in (["plan", "--help"], ["plan", "--params", "1.3B", "--nnodes", "2", "--bandwidth", "25gbps"]):
        result = run_command([sys.executable, "-X", "importtime", "-m", "phalanx", *argv], timeout=60, cwd=tmp_path)
        assert result.returncode == 0, result.output
        imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
        assert "phalanx.cli.plan" in imported
        assert not [name for name in imported if name == "torch" or name.startswith("torch.")], argv
        outputs.append(result.stdout)
    help_text, prediction = outputs
    assert "Examples:" in help_text and "--from-doctor FILE" in help_text and "10GBps are refused" in help_text
    assert "1,300,000,000 trainable parameters" in prediction
