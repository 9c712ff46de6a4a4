"""The kinds of manifest ``phalanx k8s`` writes, by their ``--kind`` name."""

from __future__ import annotations

from phalanx.errors import SettingsRefused
from phalanx.jobs.k8s import indexed_job, pytorchjob, trainjob
from phalanx.jobs.k8s.spec import Kind

KINDS: tuple[Kind, ...] = (indexed_job.KIND, trainjob.KIND, pytorchjob.KIND)


def kind_named(name: str) -> Kind:
    """The kind ``--kind NAME`` means.

    Example:
        >>> kind_named("trainjob").summary.startswith("a Kubeflow Trainer v2 TrainJob")
        True
    """
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise SettingsRefused(
        f"--kind {name!r} is not a kind phalanx k8s writes",
        "\n".join(f"{kind.name}: {kind.summary}" for kind in KINDS),
        f"pick one of those: --kind {' | '.join(kind.name for kind in KINDS)}",
    )
