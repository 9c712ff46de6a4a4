"""A Kubernetes Indexed Job and its headless Service: plain Kubernetes (1.26+ for
``podFailurePolicy``), no operator. What a pod reads back is :mod:`phalanx.clusters.indexed_job`'s;
the pod count is not in a pod's environment, so the command carries ``--nnodes``, and
``publishNotReadyAddresses`` lets pod 0's name resolve before every pod is ready.
"""

from __future__ import annotations

from phalanx.clusters.indexed_job import INDEX_VARIABLE, pod_hostname
from phalanx.exit_codes import ExitCode
from phalanx.jobs.k8s import pod
from phalanx.jobs.k8s.spec import Kind, Manifest, ManifestSpec

CONTAINER = "train"
#: The label the Job controller puts on its pods (also as batch.kubernetes.io/job-name from 1.27):
#: the one the Kubernetes documentation's headless Service selects them by.
JOB_NAME_LABEL = "job-name"
#: Exit codes that no retry can fix: settings refused, ranks that never formed one job.
PERMANENT_EXIT_CODES = (int(ExitCode.REFUSED), int(ExitCode.NOT_DISTRIBUTED))


def render(spec: ManifestSpec) -> list[Manifest]:
    """The headless Service ``spec.service`` (default: the job's name), then the Indexed Job whose pods it names.

    Example:
        >>> from phalanx.settings.entrypoint import Entrypoint
        >>> service, job = render(ManifestSpec(KIND, "train", "me/train:1", Entrypoint("train.py"), 2, 4))
        >>> job["spec"]["template"]["spec"]["containers"][0]["command"][:8]
        ['phalanx', 'run', '--nnodes', '2', '--nproc-per-node', '4', '--headless-service', 'train']
    """
    service = spec.service or spec.name
    command = spec.run_command("--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.nproc_per_node),
                               "--headless-service", service)  # fmt: skip
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": pod.metadata(spec, service),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {JOB_NAME_LABEL: spec.name}},
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": pod.metadata(spec),
            "spec": {
                "completionMode": "Indexed",
                "completions": spec.nodes,
                "parallelism": spec.nodes,
                "backoffLimit": spec.backoff,
                "podFailurePolicy": {
                    "rules": [
                        # phalanx run refused the settings, or the ranks never formed one job: a retry
                        # would fail the same way.
                        {
                            "action": "FailJob",
                            "onExitCodes": {
                                "containerName": CONTAINER,
                                "operator": "In",
                                "values": list(PERMANENT_EXIT_CODES),
                            },
                        },
                        # An eviction, a preemption or a drained node is not the job's failure.
                        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    ]
                },
                "template": pod.pod_template(
                    spec, pod.container(spec, CONTAINER, command), subdomain=service, restartPolicy="Never"
                ),
            },
        },
    ]


def pod_hostnames(name: str, nodes: int) -> list[str]:
    """The Job controller's host names of the pods, in index order."""
    return [pod_hostname(name, index) for index in range(nodes)]


KIND = Kind(
    name="indexed-job",
    summary="an Indexed Job and a headless Service (Kubernetes 1.26+, no operator)",
    render=render,
    pod_hostnames=pod_hostnames,
    controller_variables=(INDEX_VARIABLE,),
    base_env=(("PYTHONUNBUFFERED", "1"),),
)
