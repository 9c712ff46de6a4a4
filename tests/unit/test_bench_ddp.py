"""`phalanx bench ddp` without a job: settings refusals, the models as stated, the derived figures, the table."""

from __future__ import annotations

import re

import pytest

from phalanx.bench.ddp_models import CLASSES, MODELS
from phalanx.bench.ddp_report import ddp_row, format_report
from phalanx.bench.ddp_runner import StepTimes
from phalanx.bench.ddp_settings import CHOOSERS, DdpSettings, parse_compressions, parse_models
from phalanx.cli.main import build_parser
from phalanx.errors import SettingsRefused
from phalanx.runtime.model import COMPRESSIONS


def test_names_parse_in_the_order_given_and_all_expands() -> None:
    assert parse_models("conv, mlp,conv") == ("conv", "mlp")
    assert parse_models("all") == ("linear", "mlp", "conv", "transformer")
    assert parse_compressions("fp16,none") == (("fp16", "none"), False)
    everything, skip = parse_compressions("all")
    assert skip and everything == tuple(name for name in COMPRESSIONS if name not in CHOOSERS)
    assert "bf16" in everything  # skipped later, on a backend that cannot run it


@pytest.mark.parametrize(
    "make, fragments",
    [
        (
            lambda: parse_models("resnet,mlp"),
            ["--model 'resnet,mlp': unknown model resnet", "linear, mlp, conv, transformer"],
        ),
        (lambda: parse_models(" , "), ["unknown model (none given)"]),
        (lambda: parse_compressions("int8"), ["--compression 'int8': unknown compression int8", "none, fp16"]),
        (lambda: DdpSettings(steps=0), ["--steps 0: must be at least 1", "give --steps 1 or more"]),
        (lambda: DdpSettings(batch_size=0), ["--batch-size 0: must be at least 1"]),
        (lambda: DdpSettings(warmup_steps=-1), ["--warmup-steps -1: must be at least 0"]),
    ],
)
def test_bad_settings_are_refused_with_a_hint(make, fragments: list[str]) -> None:
    with pytest.raises(SettingsRefused) as refused:
        make()
    text = refused.value.render()
    assert all(fragment in text for fragment in fragments), text
    assert "HINT: " in text


@pytest.mark.skipif("auto" not in COMPRESSIONS, reason="this wrap_model has no auto compression")
def test_auto_is_refused_since_it_would_time_its_own_trial() -> None:
    with pytest.raises(SettingsRefused) as refused:
        parse_compressions("none,auto")
    assert refused.value.what == "--compression auto: not a compression of its own"
    assert refused.value.hint == "use --compression all to measure each of them side by side"


def test_bf16_is_refused_on_gloo_by_name_and_skipped_from_all() -> None:
    named = DdpSettings(compressions=("none", "bf16"))
    with pytest.raises(SettingsRefused) as refused:
        named.runnable("gloo", 2)
    assert "--compression bf16 on the gloo backend" in refused.value.what
    assert refused.value.hint.startswith("use --compression fp16")
    every = DdpSettings(compressions=("none", "fp16", "bf16", "powersgd"), skip_unsupported=True)
    runnable, skipped = every.runnable("gloo", 4)
    assert runnable == ("none", "fp16", "powersgd")
    assert list(skipped) == ["bf16"] and "gloo cannot reduce bf16" in skipped["bf16"]
    assert named.runnable("nccl", 2) == (("none", "bf16"), {})
    assert named.runnable("gloo", 1) == (("none", "bf16"), {})  # one process: no DDP, no hook, as wrap_model


def test_settings_travel_as_json_unchanged() -> None:
    settings = DdpSettings(models=("mlp", "conv"), compressions=("fp16",), skip_unsupported=True, batch_size=4, steps=7)
    assert DdpSettings.from_dict(settings.to_dict()) == settings


@pytest.mark.parametrize("name", list(MODELS))
def test_each_model_has_the_parameters_the_help_states_and_scores_ten_classes(name: str) -> None:
    import torch

    model = MODELS[name]
    network = model.build()
    assert sum(p.numel() for p in network.parameters() if p.requires_grad) == model.parameters
    assert network(torch.zeros(2, *model.sample_shape)).shape == (2, CLASSES)


def test_help_names_every_model_with_its_size_and_every_compression(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "ddp", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # as refilled to any terminal's width
    for model in MODELS.values():
        assert f"{model.name} {model.summary}: {model.parameters:,} parameters" in text
    missing = [name for name in COMPRESSIONS if not re.search(rf"\b{name}\b", text)]
    assert not missing, f"--help does not name the compressions {missing}"
    for method in ("samples/s = N x batch / step time", "model.no_sync()", "blocks in a socket read"):
        assert method in text


def test_figures_follow_the_definitions() -> None:
    times = StepTimes(step=0.040, compute=0.030, baseline=0.025, waiting_cpu=0.01)
    row = ddp_row("mlp", "fp16", 4, 8, times)
    assert row["samples_per_s"] == pytest.approx(4 * 8 / 0.040)
    assert row["baseline_samples_per_s"] == pytest.approx(8 / 0.025)
    assert row["scaling_efficiency"] == pytest.approx(0.025 / 0.040)
    assert row["comm_fraction"] == pytest.approx(0.25)
    assert row["parameters"] == MODELS["mlp"].parameters
    # a compute time above the step time (noise) is no negative communication
    assert ddp_row("mlp", "none", 2, 8, StepTimes(0.020, 0.021, 0.02, 0.0))["comm_fraction"] == 0.0


def _report(**changes) -> dict:
    rows = [
        ddp_row("linear", "none", 4, 32, StepTimes(0.050, 0.020, 0.040, 0.004)),
        ddp_row("linear", "powersgd", 4, 32, StepTimes(0.0312, 0.025, 0.040, 0.002)),
    ]
    report = {
        "tool": "bench ddp", "world_size": 4, "nodes": 2, "backend": "gloo",
        "settings": DdpSettings(batch_size=32, steps=20, warmup_steps=3).to_dict(), "skipped": {},
        "ranks": [{"rank": r, "node": f"node{r // 2}", "host": "box", "pid": 100 + r, "device": "cpu"} for r in range(4)],
        "cpu_cores": {"box": 8}, "results": rows,
    }  # fmt: skip
    return {**report, **changes}


def test_the_table_shows_each_row_with_units() -> None:
    lines = format_report(_report()).splitlines()
    assert (
        lines[0]
        == "# phalanx bench ddp: 4 ranks on 2 node(s), backend gloo, batch 32 per process, medians of 20 steps after 3 warm-up"
    )
    header = next(line for line in lines if not line.startswith("#"))
    columns = ("model", "params", "compression", "world", "samples/s", "1-process samples/s", "scaling eff.",
               "step (ms)", "compute (ms)", "comm %")  # fmt: skip
    assert re.fullmatch(r"\s*" + r"\s+".join(map(re.escape, columns)), header), header
    rows = [line.split() for line in lines if line.startswith("  ") and "model" not in line]
    # model, params, compression, world, samples/s, 1-process samples/s, eff, step, compute, comm %
    assert rows[0] == ["linear", "1.51M", "none", "4", "2560.0", "800.0", "0.80", "50.00", "20.00", "60.0"]
    assert rows[1] == ["linear", "1.51M", "powersgd", "4", "4102.6", "800.0", "1.28", "31.20", "25.00", "19.9"]
    assert not [line for line in lines if "share" in line or "skipped" in line]  # no notes were due


def test_notes_say_what_was_skipped_and_when_ranks_share_cores() -> None:
    report = _report(skipped={"bf16": "gloo cannot reduce bf16 gradients"}, cpu_cores={"box": 2})
    text = format_report(report)
    assert "# skipped --compression bf16: gloo cannot reduce bf16 gradients" in text
    assert "# 4 ranks share 2 CPU cores on box" in text
    busy = _report(results=[ddp_row("mlp", "none", 4, 8, StepTimes(0.02, 0.01, 0.01, 0.5))])
    assert "used up to 50% of a core" in format_report(busy)
    short = _report(settings=DdpSettings(batch_size=32, steps=20, warmup_steps=1).to_dict())
    assert "medians of 20 steps after 1 or 3 warm-up" in format_report(short)  # powersgd's warm-up is 3


def test_the_plot_is_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from phalanx.bench.plot import plot_ddp_throughput

    path = tmp_path / "ddp.png"
    plot_ddp_throughput(_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
