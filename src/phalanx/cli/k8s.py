"""``phalanx k8s``: Kubernetes manifests that run SCRIPT with `phalanx run` in every pod.

Examples:
  an Indexed Job and its headless Service, 2 pods of 4 GPUs, applied at once:
    phalanx k8s --image registry.example.com/me/train:1.0 --nnodes 2 --gpus-per-node 4 \\
        train.py --epochs 90 | kubectl apply -f -
  a Kubeflow TrainJob (Trainer v2), into a folder, one file per object:
    phalanx k8s --kind trainjob --image me/train:1.0 --nnodes 4 --gpus-per-node 8 --output k8s/ train.py
    kubectl apply -f k8s/
  a Kubeflow PyTorchJob, a variable on every pod, CPU and memory requests:
    phalanx k8s --kind pytorchjob --image me/train:1.0 --nnodes 2 --nproc-per-node 2 --cpu 8 --memory 32Gi \\
        --env NCCL_DEBUG=INFO train.py

Kinds (--kind):
  indexed-job  an Indexed Job (completions = parallelism = --nnodes) and a headless Service
               (clusterIP None, publishNotReadyAddresses) named by the pods' subdomain; pod 0,
               <job>-0.<service>, hosts the rendezvous (`phalanx run --headless-service`).
               Refusals (exit 2) and ranks that trained alone (exit 5) fail the Job at once; an
               eviction is retried without counting. Kubernetes 1.26 or newer, no operator.
  trainjob     a Kubeflow Trainer v2 TrainJob on a torch runtime (--runtime, default
               torch-distributed); the Trainer gives every pod PET_NNODES, PET_NODE_RANK,
               PET_MASTER_ADDR... Kubeflow Trainer v2.2 or newer (the /dev/shm volume is a
               runtimePatch).
  pytorchjob   a Kubeflow PyTorchJob v1: one Master and --nnodes - 1 Workers (restartPolicy
               OnFailure); the training operator (v1.7 or newer) gives every pod MASTER_ADDR,
               RANK, WORLD_SIZE and PET_ variables.

The image must have phalanx installed (pip install it with PyTorch into the image) and the
training script at the path SCRIPT names inside the image (relative to its working directory).
Every pod runs `phalanx run [launch options] SCRIPT ARGS`; the node count goes into the manifest
(--nnodes: a fixed number), --nproc-per-node defaults to --gpus-per-node (else 1), and each pod
gets a memory-backed /dev/shm (the container's 64 MiB is too small for DataLoader workers and
NCCL). The launch options are resolved as the pods will see them: the flags, the --config file
(else $PHALANX_CONFIG; its settings become flags: the pods do not have it) and --env
PHALANX_<FLAG>=...; this shell's other variables do not reach the pods. --simulate-nodes, --standalone and --dry-run do not apply to
pods, nor --rdzv-endpoint and --headless-service where the controller names the endpoint
(trainjob, pytorchjob); with an Indexed Job, --headless-service names the Service (default: the
job's name).

Exit codes: 0 the manifests were written (stdout, or the files of --output, listed); 2 settings
refused (nothing was written).
"""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.cli import command_parser
from phalanx.settings import arguments
from phalanx.settings.options import add_launch_options, add_script_arguments


def add_parser(commands: Any) -> None:
    parser = command_parser(
        commands,
        "k8s",
        "write Kubernetes manifests (Indexed Job, Kubeflow TrainJob or PyTorchJob): phalanx run in every pod",
        __doc__,
        usage="phalanx k8s --image IMAGE [--kind KIND] [options] SCRIPT [ARGS...]",
    )
    group = parser.add_argument_group("Kubernetes")
    group.add_argument("--image", metavar="IMAGE", help="the container image every pod runs (with phalanx installed)")
    group.add_argument("--kind", default="indexed-job", metavar="KIND",
                       help="indexed-job (default), trainjob or pytorchjob")  # fmt: skip
    group.add_argument("--name", metavar="NAME",
                       help="the job's name, a DNS-1035 label (default: the script's name, train_ddp.py -> train-ddp)")  # fmt: skip
    group.add_argument("--namespace", metavar="NAME", help="the namespace (default: kubectl's current one)")
    group.add_argument(
        "--gpus-per-node",
        type=arguments.count("--gpus-per-node", example=8),
        metavar="N",
        help="GPUs of each pod (nvidia.com/gpu limits)",
    )
    group.add_argument("--cpu", metavar="QUANTITY", help="CPU each pod requests (8, 500m)")
    group.add_argument("--memory", metavar="QUANTITY", help="memory each pod requests (64Gi)")
    group.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="a variable on every pod (repeatable)")  # fmt: skip
    group.add_argument("--volume", action="append", default=[], metavar="CLAIM:PATH",
                       help="mount the PersistentVolumeClaim CLAIM at PATH in every pod (repeatable); the script's "
                       "--checkpoint-dir must be on one, or a retried pod starts from step 0")  # fmt: skip
    group.add_argument(
        "--runtime", metavar="NAME", help="trainjob: the ClusterTrainingRuntime (default torch-distributed)"
    )
    group.add_argument("--backoff-limit", type=arguments.count("--backoff-limit", minimum=0, example=3), metavar="N",
                       help="indexed-job, pytorchjob: pod failures before the job fails (default 3 x nodes: a failure "
                       "usually ends every pod)")  # fmt: skip
    group.add_argument("--output", metavar="DIR", help="write one file per object into DIR instead of printing them")
    add_launch_options(parser)
    add_script_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from phalanx.console import say
    from phalanx.jobs.k8s.render import header, to_yaml, write_folder
    from phalanx.jobs.k8s.settings import spec_from_args, unseen_variables

    spec = spec_from_args(args)
    for name in unseen_variables(os.environ, spec):
        say(f"phalanx k8s: note: {name} is set in this shell, but the pods do not see it; "
            f"--env {name}=VALUE gives it to them")  # fmt: skip
    manifests = spec.kind.render(spec)
    if args.output is None:
        print(to_yaml(manifests, header(spec)), end="")
        say("phalanx k8s: apply it with `kubectl apply -f FILE` (or pipe it to `kubectl apply -f -`)")
        return 0
    for path in write_folder(manifests, Path(args.output), header(spec)):
        print(path)
    say(f"phalanx k8s: apply them with `kubectl apply -f {args.output}`")
    return 0
