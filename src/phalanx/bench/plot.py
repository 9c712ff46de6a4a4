"""Plots of the bench reports: busbw against size (with the line rate when known), DDP samples/s.

matplotlib is optional (``pip install 'phalanx[plot]'``); the path is checked before any job
starts, so a long benchmark never ends without its plot.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from phalanx.errors import SettingsRefused


def check_plot_path(path: str) -> None:
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise SettingsRefused(
            f"--plot {path}: the file must end in .png", hint=f"for example --plot {target.with_suffix('.png')}"
        )
    if not target.parent.resolve().is_dir():
        raise SettingsRefused(
            f"--plot {path}: the folder {target.parent} does not exist",
            "the plot is written at the end of the run; a missing folder would lose it.",
            f"create it first (mkdir -p {target.parent}) or pick another path",
        )
    if importlib.util.find_spec("matplotlib") is None:
        raise SettingsRefused(
            f"--plot {path} needs matplotlib, which is not installed",
            hint="pip install 'phalanx[plot]' (or pip install matplotlib), or drop --plot",
        )


def _size_label(size: float) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size:g}"


def plot_busbw(report: dict[str, Any], path: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 5))
    for result in report["results"]:
        for variant in ("out_of_place", "in_place"):
            points = [(row["size_bytes"], row[variant]["busbw"]) for row in result["rows"] if row[variant]]
            if points:
                sizes, busbw = zip(*points)
                label = f"{result['collective']} ({variant.replace('_', '-')})"
                axes.plot(sizes, busbw, marker="o", label=label)
    if report.get("line_rate"):
        rate = report["line_rate"] / 1e9
        axes.axhline(
            rate,
            color="grey",
            linestyle="--",
            label=f"line rate{' of ' + report['interface'] if report['interface'] else ''} ({rate:.3g} GB/s)",
        )
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda size, _: _size_label(size)))
    axes.set_xlabel("size (B)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(
        f"phalanx bench collectives: {report['world_size']} ranks, {report['nodes']} node(s), {report['backend']}"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def plot_ddp_throughput(report: dict[str, Any], path: str) -> None:
    """`phalanx bench ddp`: samples/s as bars grouped by model, one bar per compression, each with
    a tick at perfect scaling (world x the 1-process samples/s measured beside it)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot

    models = list(dict.fromkeys(row["model"] for row in report["results"]))
    compressions = list(dict.fromkeys(row["compression"] for row in report["results"]))
    width = 0.8 / len(compressions)
    figure, axes = pyplot.subplots(figsize=(10, 5))
    for offset, compression in enumerate(compressions):
        rows = [row for row in report["results"] if row["compression"] == compression]
        positions = [models.index(row["model"]) + (offset - (len(compressions) - 1) / 2) * width for row in rows]
        axes.bar(positions, [row["samples_per_s"] for row in rows], width, label=f"compression {compression}")
        ideal = [row["world_size"] * row["baseline_samples_per_s"] for row in rows]
        axes.hlines(ideal, [x - width / 2 for x in positions], [x + width / 2 for x in positions], color="black",
                    zorder=3, label="perfect scaling (world x 1 process)" if offset == 0 else None)  # fmt: skip
    axes.set_xticks(range(len(models)), models)
    throughputs = [row["samples_per_s"] for row in report["results"]]
    if max(throughputs) > 20 * min(throughputs):  # models apart by orders of magnitude: keep the small bars visible
        axes.set_yscale("log")
    axes.set_ylabel("samples/s (all ranks)")
    axes.set_title(f"phalanx bench ddp: {report['world_size']} ranks, {report['nodes']} node(s), {report['backend']}, "
                   f"batch {report['settings']['batch_size']} per process")  # fmt: skip
    axes.grid(True, axis="y", which="both", alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never over them
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
