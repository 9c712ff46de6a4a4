"""A Kubernetes Indexed Job with a headless Service: the pod's index, the Service's DNS names.

Kubernetes gives each pod of an Indexed Job ``JOB_COMPLETION_INDEX`` and the host name
``<job>-<index>``; with the pod template's ``subdomain`` set to a headless Service, pod 0 is
``<job>-0.<service>``. The Service's name is not in the pod's environment, so it comes from
``--headless-service`` (``PHALANX_HEADLESS_SERVICE``), and the pod count (the Job's
``completions``) from ``--nnodes``.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from phalanx.clusters.environment import ClusterEnvironment, Found, Placement
from phalanx.errors import SettingsRefused
from phalanx.settings import values

#: The variable the Job controller gives each pod of an Indexed Job: its index.
INDEX_VARIABLE = "JOB_COMPLETION_INDEX"


def pod_hostname(job: str, index: int) -> str:
    """The Job controller's host name for pod ``index`` of Job ``job``: ``<job>-<index>``."""
    return f"{job}-{index}"


def job_of(hostname: str, index: int) -> str | None:
    """The Job's name in pod ``index``'s host name (first label); None where it is not one."""
    label, suffix = hostname.split(".")[0], pod_hostname("", index)
    return label.removesuffix(suffix) if label.endswith(suffix) and label != suffix else None


class IndexedJob(ClusterEnvironment):
    """A pod of a Kubernetes Indexed Job: its index, and pod 0's name in a headless Service."""

    name = "Kubernetes Indexed Job"
    markers = (INDEX_VARIABLE,)

    def __init__(self, environ: Mapping[str, str], headless_service: str | None = None) -> None:
        super().__init__(environ)
        self.headless_service = headless_service

    def placement(self) -> Placement:
        index = self._int(INDEX_VARIABLE)
        assert index is not None
        hostname = self.environ.get("HOSTNAME") or socket.gethostname()
        job = job_of(hostname, index.value)
        endpoint = None
        if self.headless_service and job:
            host = f"{pod_hostname(job, 0)}.{self.headless_service}"
            try:
                parsed = values.parse_endpoint(host)
            except values.InvalidValue:
                raise SettingsRefused(
                    f"{self.name}: pod 0's name {host!r} is not a valid host name",
                    f"it is made of the pod's host name {hostname!r} and --headless-service {self.headless_service}.",
                    "check the Service's name",
                ) from None
            endpoint = Found(parsed, f"pod 0 of the Job {job} in the headless Service {self.headless_service}")
        elif self.headless_service:
            raise SettingsRefused(
                f"{self.name}: the host name {hostname!r} does not end with the pod's index -{index.value}",
                "Kubernetes names an Indexed Job's pods <job>-<index>; phalanx takes pod 0's name from it.",
                "give the endpoint yourself: --rdzv-endpoint <job>-0.<service>:29400",
            )
        return Placement(
            name=self.name,
            environment=f"{self.name}" + (f" {job}" if job else ""),
            node_rank=Found(index.value, f"{index.source} (the pod's index)"),
            endpoint=endpoint,
            rdzv_id=Found(job, "the Job's name in the host name") if job else None,
            dns_may_lag=True,
            no_endpoint=(
                "the pod's environment does not name the first pod's address.",
                "give the headless Service of the pod template's subdomain: --headless-service NAME "
                "(PHALANX_HEADLESS_SERVICE), or --rdzv-endpoint HOST[:PORT]",
            ),
        )
