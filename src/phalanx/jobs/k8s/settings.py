"""``phalanx k8s``'s command line as a :class:`ManifestSpec`; what cannot work in a pod is refused
before anything is written. The launch options are resolved as the pods will see them: the flags,
the ``--config`` file as flags, and ``--env``'s variables, never this shell's.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from pathlib import Path

from phalanx.errors import SettingsRefused
from phalanx.jobs import command_line
from phalanx.jobs.k8s.kinds import kind_named
from phalanx.jobs.k8s.spec import ManifestSpec, check_env, parse_env, parse_volumes
from phalanx.jobs.k8s.trainjob import KIND as TRAINJOB
from phalanx.settings.entrypoint import Entrypoint
from phalanx.settings.options import LAUNCH_OPTIONS, given_flags, given_settings, refuse_settings
from phalanx.settings.values import Resolved, parse_flag

#: Launch options that describe a run on this machine, not a pod.
_NOT_IN_A_POD = {"simulate_nodes": "rehearses several nodes on this machine",
                 "standalone": "means one node with a private rendezvous",
                 "dry_run": "prints a plan and starts nothing; phalanx k8s only writes manifests anyway"}  # fmt: skip
#: Launch options the manifest itself carries: its node count, processes per node and Service.
_IN_THE_MANIFEST = ("nnodes", "nproc_per_node", "headless_service")


def spec_from_args(args: argparse.Namespace) -> ManifestSpec:
    """The checked spec of the manifests ``phalanx k8s`` was asked for.

    Example:
        >>> from phalanx.cli.main import build_parser
        >>> args = build_parser().parse_args(["k8s", "--image", "me/t:1", "--nnodes", "2", "--gpus-per-node", "4", "t.py"])
        >>> spec = spec_from_args(args)
        >>> spec.kind.name, spec.nodes, spec.nproc_per_node
        ('indexed-job', 2, 4)
    """
    kind = kind_named(args.kind)
    if not args.image:
        raise SettingsRefused(
            "no --image given",
            "every pod runs `phalanx run` in a container of this image: it needs phalanx installed (with PyTorch) "
            "and the training script.",
            "for example --image registry.example.com/me/train:1.0",
        )
    entrypoint = Entrypoint.from_args(args, "phalanx k8s --image IMAGE [options] train.py [ARGS...]")
    env = parse_env(args.env)
    check_env(env, kind)
    settings, _, config = given_settings(args, os.environ, variables=dict(env))
    command = f"phalanx k8s --kind {kind.name}"
    refuse_settings(
        settings, _NOT_IN_A_POD, command, "to rehearse on this machine first: phalanx run --simulate-nodes N ..."
    )
    refuse_settings(
        settings, kind.controller_options, command, "the controller's endpoint is the one every pod can reach"
    )
    _refuse_kind_options(args, kind.name)
    return ManifestSpec(
        kind=kind,
        name=args.name if args.name is not None else default_name(entrypoint),
        image=args.image,
        entrypoint=entrypoint,
        nodes=_fixed_nodes(settings.get("nnodes")),
        nproc_per_node=_nproc_per_node(settings.get("nproc_per_node"), args.gpus_per_node),
        launch_flags=launch_flags(args, config),
        namespace=args.namespace,
        service=settings["headless_service"].value if "headless_service" in settings else None,
        gpus_per_node=args.gpus_per_node,
        cpu=args.cpu,
        memory=args.memory,
        env=env,
        volumes=parse_volumes(args.volume),
        backoff_limit=args.backoff_limit,
        written_by=command_line("k8s"),
        **({"runtime": args.runtime} if args.runtime else {}),
    )


def launch_flags(args: argparse.Namespace, config: dict[str, object]) -> tuple[str, ...]:
    """The launch flags every pod's ``phalanx run`` gets: those given, and the ``--config`` file's
    settings as flags (the pods do not have the file); not those the manifest carries itself.

    Example:
        >>> from phalanx.cli.main import build_parser
        >>> args = build_parser().parse_args(["k8s", "--nnodes", "2", "--max-restarts", "1", "--all-ranks", "t.py"])
        >>> launch_flags(args, {"join_timeout": 600, "standalone": False})
        ('--max-restarts', '1', '--join-timeout', '600', '--all-ranks')
    """
    merged = dict(vars(args))
    for option in LAUNCH_OPTIONS:
        value = config.get(option.field)
        if merged[option.field] is None and value is not None:
            merged[option.field] = (True if parse_flag(value) else None) if option.is_switch else value
    return tuple(given_flags(merged, leave_out=_IN_THE_MANIFEST))


def default_name(entrypoint: Entrypoint) -> str:
    """The job's name from the script's: ``train_ddp.py`` -> ``train-ddp`` (a DNS-1035 label).

    Example:
        >>> default_name(Entrypoint("examples/Train_DDP.py")), default_name(Entrypoint("pkg.train", is_module=True))
        ('train-ddp', 'train')
    """
    stem = entrypoint.target.rsplit(".", 1)[-1] if entrypoint.is_module else Path(entrypoint.target).stem
    name = re.sub(r"^[^a-z]+", "", re.sub(r"[^a-z0-9]+", "-", stem.lower()))[:40].strip("-")
    if not name:
        raise SettingsRefused(
            f"no job name can be made of {entrypoint.target!r}",
            "the job's name must start with a letter and hold only lower-case letters, digits and '-'.",
            "give one: --name train-resnet",
        )
    return name


def _refuse_kind_options(args: argparse.Namespace, kind: str) -> None:
    """Options of one kind given with another: a wrong guess of what will happen."""
    if args.runtime is not None and kind != TRAINJOB.name:
        raise SettingsRefused(
            f"--runtime {args.runtime} with --kind {kind}",
            "--runtime names the Kubeflow Trainer runtime of a TrainJob.",
            "add --kind trainjob, or drop --runtime",
        )
    if args.backoff_limit is not None and kind == TRAINJOB.name:
        raise SettingsRefused(
            "--backoff-limit with --kind trainjob",
            "a TrainJob's retries are its runtime's (the JobSet's failurePolicy), not the TrainJob's.",
            "drop it, or set maxRestarts in the runtime's JobSet failurePolicy",
        )


def _fixed_nodes(nnodes: Resolved | None) -> int:
    if nnodes is None:
        return 1
    if nnodes.value.is_elastic:
        raise SettingsRefused(
            f"--nnodes {nnodes.value} (from {nnodes.origin}): a manifest's node count is a fixed number",
            "the Job's completions, a TrainJob's numNodes and a PyTorchJob's replicas are each one number.",
            f"give the number of pods: --nnodes {nnodes.value.max}",
        )
    return nnodes.value.min


def _nproc_per_node(nproc: Resolved | None, gpus_per_node: int | None) -> int:
    if nproc is None:
        return gpus_per_node or 1
    if isinstance(nproc.value, str):
        raise SettingsRefused(
            f"--nproc-per-node {nproc.value} (from {nproc.origin}): the manifest needs a number",
            "a TrainJob's numProcPerNode is a number, and a PyTorchJob's WORLD_SIZE is counted from it.",
            "give the number: --nproc-per-node N (by default the --gpus-per-node, else 1)",
        )
    return nproc.value


def unseen_variables(environ: Mapping[str, str], spec: ManifestSpec) -> list[str]:
    """This shell's ``PHALANX_<FLAG>`` variables that ``--env`` does not give the pods, which see
    only the manifest's variables (their ``PET_`` ones are the controller's, or refused)."""
    given = {name for name, _ in spec.env}
    return [option.env_var for option in LAUNCH_OPTIONS if option.env_var in environ and option.env_var not in given]
