"""What ``phalanx k8s`` renders: one :class:`ManifestSpec`, checked in ``__post_init__`` so that no
renderer sees a name, image or quantity Kubernetes would refuse, and the :class:`Kind` of object
it becomes (an Indexed Job, a TrainJob, a PyTorchJob).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.errors import SettingsRefused
from phalanx.settings.entrypoint import Entrypoint

#: A DNS-1035 label, as Kubernetes checks the names of Services, Jobs' pods and these jobs.
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: A DNS-1123 label: a namespace's name.
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: The longest DNS label: a pod's host name, a Service's name.
MAX_LABEL = 63
#: A resource quantity as Kubernetes reads it (the pattern of the CRDs' resource fields).
_QUANTITY = re.compile(
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
#: An environment variable's name as the kubelet takes it (k8s.io/apimachinery IsEnvVarName).
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
#: A PersistentVolumeClaim's name: a DNS-1123 subdomain.
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: The script's own flag for its checkpoint folder (examples/, phalanx.Run's scripts).
CHECKPOINT_FLAG = "--checkpoint-dir"
#: The manifests' object: a dict that becomes one YAML document.
Manifest = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    """One kind of manifest: how it renders, and what its controller gives every pod.

    A controller's variables (Kubeflow's ``PET_*``, the Job controller's ``JOB_COMPLETION_INDEX``)
    cannot also come from ``--env``, and the launch options it gives (the endpoint) cannot be set.
    """

    #: ``--kind`` on the command line: ``indexed-job``.
    name: str
    #: One line for the manifests' header and refusals: what it is and what the cluster needs for it.
    summary: str
    render: Callable[[ManifestSpec], list[Manifest]]
    #: The pods' host names, in node-rank order, for a job's name and node count.
    pod_hostnames: Callable[[str, int], list[str]]
    #: Environment variables the controller sets on every pod.
    controller_variables: tuple[str, ...] = ()
    #: Launch options the controller gives (their LaunchSpec field), with why, for the refusal.
    controller_options: Mapping[str, str] = field(default_factory=dict)
    #: Variables the manifest sets itself (``--env`` may override them).
    base_env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ManifestSpec:
    """Everything a manifest says: the job, its pods' resources, and what every pod runs.

    ``launch_flags`` are ``phalanx run``'s launch flags as the pods get them; the kind adds what
    its controller does not give (an Indexed Job's node count and Service).
    """

    kind: Kind
    name: str
    image: str
    entrypoint: Entrypoint
    nodes: int
    nproc_per_node: int
    launch_flags: tuple[str, ...] = ()
    namespace: str | None = None
    #: The headless Service of an Indexed Job (default: the job's name).
    service: str | None = None
    #: The ClusterTrainingRuntime a TrainJob refers to.
    runtime: str = "torch-distributed"
    gpus_per_node: int | None = None
    cpu: str | None = None
    memory: str | None = None
    #: ``--env NAME=VALUE``, in the order given.
    env: tuple[tuple[str, str], ...] = ()
    #: ``--volume CLAIM:PATH``: PersistentVolumeClaims mounted in every pod, in the order given.
    volumes: tuple[tuple[str, str], ...] = ()
    #: Pod failures before the job fails; None: 3 x nodes (a failure usually ends every pod).
    backoff_limit: int | None = None
    #: The command line that wrote the manifests, for their first comment.
    written_by: str = ""

    def __post_init__(self) -> None:
        _check_name(self.name, "--name", self.kind.pod_hostnames(self.name, self.nodes))
        if self.service is not None:
            _check_name(self.service, "--headless-service", [])
        if self.namespace is not None and not (_DNS_1123.match(self.namespace) and len(self.namespace) <= MAX_LABEL):
            raise SettingsRefused(
                f"--namespace {self.namespace!r} is not a Kubernetes namespace's name",
                "a namespace's name is 1 to 63 lower-case letters, digits and '-', starting and ending with a letter "
                "or digit.",
                "kubectl get namespaces lists them; leave --namespace out for kubectl's current one",
            )
        if not self.image or any(c.isspace() for c in self.image):
            raise SettingsRefused(
                f"--image {self.image!r} is not a container image",
                "every pod runs `phalanx run` from this image, so it needs phalanx and the training script.",
                "for example --image registry.example.com/me/train:1.0",
            )
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise SettingsRefused(
                f"{self.nodes} nodes of {self.nproc_per_node} processes: a job needs at least one of each",
                hint="for example --nnodes 2 --nproc-per-node 4",
            )
        for flag, quantity in (("--cpu", self.cpu), ("--memory", self.memory)):
            if quantity is not None and not _QUANTITY.match(quantity):
                raise SettingsRefused(
                    f"{flag} {quantity!r} is not a Kubernetes resource quantity",
                    "Kubernetes reads a number with an optional suffix: m (thousandths), k, M, G, or Ki, Mi, Gi.",
                    "for example --cpu 8 --memory 64Gi",
                )
        check_env(self.env, self.kind)
        _check_volumes(self.volumes, self.entrypoint)

    @property
    def backoff(self) -> int:
        """Pod failures the job tolerates: a failed node usually ends every pod, so 3 tries of all."""
        return self.backoff_limit if self.backoff_limit is not None else 3 * self.nodes

    @property
    def pod_env(self) -> list[tuple[str, str]]:
        """The variables the manifest sets on every pod: the kind's own, then ``--env`` over them."""
        given = dict(self.env)
        return [(name, value) for name, value in self.kind.base_env if name not in given] + list(self.env)

    def run_command(self, *first: str) -> list[str]:
        """The command every pod runs: ``phalanx run``, ``first`` (the kind's flags), the launch
        flags, then the script and its arguments.

        Example:
            >>> from phalanx.jobs.k8s.kinds import kind_named
            >>> spec = ManifestSpec(kind_named("trainjob"), "train", "me/train:1", Entrypoint("train.py", ("--epochs", "3")),
            ...                     nodes=2, nproc_per_node=4, launch_flags=("--max-restarts", "1"))
            >>> spec.run_command()
            ['phalanx', 'run', '--max-restarts', '1', 'train.py', '--epochs', '3']
        """
        return ["phalanx", "run", *first, *self.launch_flags, *self.entrypoint.argv]


def parse_volumes(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``--volume CLAIM:PATH`` items as (claim, path) pairs.

    Example:
        >>> parse_volumes(["checkpoints:/ckpt"])
        (('checkpoints', '/ckpt'),)
    """
    return _pairs(items, "--volume", ":", "CLAIM:PATH", value_required=True,
                  why="each --volume mounts a PersistentVolumeClaim at a path in every pod.",
                  hint="for example --volume checkpoints:/ckpt (kubectl get pvc lists the claims)")  # fmt: skip


def _check_volumes(volumes: Sequence[tuple[str, str]], entrypoint: Entrypoint) -> None:
    """Refuses a claim Kubernetes would not name, a path it would not mount, and a checkpoint
    folder that no volume holds: a retried or rescheduled pod starts with an empty filesystem."""
    paths = [path.rstrip("/") or "/" for _, path in volumes]
    for (claim, path), clean in zip(volumes, paths):
        if not _CLAIM.match(claim) or len(claim) > 253:
            raise SettingsRefused(
                f"--volume {claim}:{path}: {claim!r} is not a PersistentVolumeClaim's name",
                "a claim's name is lower-case letters, digits, '-' and '.', starting and ending with a letter or digit.",
                "kubectl get pvc lists the claims of the namespace",
            )
        if not clean.startswith("/") or clean in ("/", "/dev/shm") or paths.count(clean) > 1 or not clean.isprintable():
            raise SettingsRefused(
                f"--volume {claim}:{path}: {path!r} cannot be a mount point here",
                "the path must be absolute and printable, not / or /dev/shm (the pods' shared memory), and mount "
                "one volume only.",
                f"for example --volume {claim}:/ckpt",
            )
    folder = _flag_value(entrypoint.args, CHECKPOINT_FLAG)
    if folder is not None and not any(folder == p or folder.startswith(p.rstrip("/") + "/") for p in paths):
        mount_point = folder if folder.startswith("/") else "/ckpt"
        raise SettingsRefused(
            f"the script's {CHECKPOINT_FLAG} {folder} is on the pod's own filesystem",
            "a pod that is retried or rescheduled starts with an empty one: the checkpoints are gone, and the "
            "training starts from step 0.",
            f"mount a PersistentVolumeClaim there: --volume CLAIM:{mount_point} (ReadWriteMany when the pods of several "
            "nodes share the folder)"
            + ("" if folder.startswith("/") else f", and give {CHECKPOINT_FLAG} {mount_point}"),
        )


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag VALUE`` or ``flag=VALUE`` in a script's arguments, the last one given."""
    found = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            found = args[index + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1 :]
    return found


def _check_name(name: str, flag: str, hostnames: Sequence[str]) -> None:
    if not _DNS_1035.match(name) or len(name) > MAX_LABEL:
        raise SettingsRefused(
            f"{flag} {name!r} is not a valid Kubernetes name",
            "it names the job, its Service and its pods' DNS names: a DNS-1035 label, 1 to 63 lower-case letters, "
            "digits and '-', starting with a letter and ending with a letter or digit.",
            f"for example {flag} train-resnet",
        )
    longest = max(hostnames, key=len, default="")
    if len(longest) > MAX_LABEL:
        raise SettingsRefused(
            f"{flag} {name!r} is too long: the pods' host names would be up to {len(longest)} characters ({longest})",
            f"a pod's host name is a DNS label of at most {MAX_LABEL} characters.",
            f"give a shorter --name, at most {len(name) - (len(longest) - MAX_LABEL)} characters",
        )


def check_env(env: Sequence[tuple[str, str]], kind: Kind) -> None:
    """Refuses ``--env`` names that Kubernetes would refuse, given twice, or that the kind's
    controller sets (a second definition would contradict it)."""
    seen: set[str] = set()
    for name, _ in env:
        if not _ENV_NAME.match(name):
            raise SettingsRefused(
                f"--env {name}=...: {name!r} is not an environment variable's name",
                "Kubernetes takes letters, digits, '_', '-' and '.', not starting with a digit.",
                "for example --env NCCL_DEBUG=INFO",
            )
        if name in seen:
            raise SettingsRefused(f"--env {name} is given twice", hint="give each variable once")
        seen.add(name)
        if name in kind.controller_variables or name.startswith("PET_"):
            whose = "the controller sets it on every pod" if name in kind.controller_variables else \
                "PET_ variables describe the job to torchrun"  # fmt: skip
            raise SettingsRefused(
                f"--env {name} with --kind {kind.name}",
                f"{whose}; phalanx k8s writes the job's shape into the manifest.",
                "drop it, and give the job's shape with the flags (--nnodes, --nproc-per-node)",
            )


def parse_env(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``--env NAME=VALUE`` items as (name, value) pairs; the value may hold '=' too.

    Example:
        >>> parse_env(["NCCL_DEBUG=INFO", "OPTS=a=b"])
        (('NCCL_DEBUG', 'INFO'), ('OPTS', 'a=b'))
    """
    return _pairs(items, "--env", "=", "NAME=VALUE", value_required=False,
                  why="each --env sets one environment variable on every pod.",
                  hint="write --env NAME=VALUE, for example --env NCCL_DEBUG=INFO (an empty value: --env NAME=)")  # fmt: skip


def _pairs(items: Sequence[str], flag: str, separator: str, form: str, *, value_required: bool, why: str,
           hint: str) -> tuple[tuple[str, str], ...]:  # fmt: skip
    """``flag KEY<separator>VALUE`` items as (key, value) pairs, split at the first separator."""
    pairs = []
    for item in items:
        key, found, value = item.partition(separator)
        if not found or not key or (value_required and not value):
            raise SettingsRefused(f"{flag} {item!r} has no {form}", why, hint)
        pairs.append((key, value))
    return tuple(pairs)
