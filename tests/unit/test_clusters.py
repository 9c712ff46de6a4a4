"""Cluster environments, each from exactly the variables its scheduler sets.

The variables are the schedulers' own, as these tests spell out: SLURM's as a real slurmd 22.05
sets them inside srun (the cluster tests run the real thing); Kubeflow's from training-operator
v1.5.0 to v1.9.0 (pkg/controller.v1/pytorch/envvar.go, master.go) and Trainer v2
(pkg/runtime/framework/plugins/torch/torch.go); a Kubernetes control plane cannot run here.
"""

from __future__ import annotations

import pytest

from phalanx.clusters import detect
from phalanx.clusters.indexed_job import IndexedJob
from phalanx.clusters.pytorchjob import PyTorchJob
from phalanx.clusters.skypilot import SkyPilot
from phalanx.clusters.slurm import Slurm, rendezvous_port, tasks_per_node
from phalanx.clusters.torchrun_variables import TorchrunVariables
from phalanx.errors import SettingsRefused
from phalanx.settings.values import Endpoint, NodeRange

#: What srun -N2 --ntasks-per-node=1 gives the task on the second node (read off slurmd 22.05).
SLURM_STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
}  # fmt: skip
#: A TrainJob's pod 1 (Kubeflow Trainer v2): PET_ variables, and JOB_COMPLETION_INDEX as a JobSet pod.
TRAINJOB = {
    "KUBERNETES_SERVICE_HOST": "10.96.0.1", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "mnist-node-0-0.mnist", "PET_MASTER_PORT": "29400", "JOB_COMPLETION_INDEX": "1",
}  # fmt: skip
#: A PyTorchJob's worker 0 (pod index 1) from training-operator v1.7+, nprocPerNode 2, 1 master + 1 worker.
PYTORCHJOB_V17 = {
    "KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "mnist-master-0", "MASTER_PORT": "23456",
    "PET_MASTER_ADDR": "mnist-master-0", "PET_MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": "1",
    "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2", "PET_NNODES": "2",
}  # fmt: skip
#: The same job from training-operator v1.6 and older: WORLD_SIZE counts the pods.
PYTORCHJOB_V16 = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "mnist-master-0", "MASTER_PORT": "23456",
                  "WORLD_SIZE": "2", "RANK": "1"}  # fmt: skip
SKYPILOT = {"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8", "SKYPILOT_TASK_ID": "sky-2026-12-03-10-00-00-000000_mycluster_1"}  # fmt: skip


def test_nothing_set_is_no_environment():
    assert detect({"HOME": "/root", "PATH": "/bin"}) is None


def test_slurm_step_scope():
    environment = detect(SLURM_STEP)
    assert isinstance(environment, Slurm)
    placement = environment.placement()
    assert placement.nnodes.value == NodeRange(2, 2) and placement.nnodes.source == "SLURM_STEP_NUM_NODES=2"
    assert placement.node_rank.value == 1
    assert placement.endpoint.value == Endpoint("gpu07", rendezvous_port(4242))
    assert placement.rdzv_id.value == "slurm-4242"
    assert placement.hosts == ("gpu07", "gpu08")
    assert placement.environment == "SLURM job 4242 (step 0) on gpu[07-08]"


def test_a_step_on_part_of_the_allocation_is_a_job_of_its_own_nodes():
    environ = {**SLURM_STEP, "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4",
               "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "gpu09", "SLURM_STEP_NUM_NODES": "1",
               "SLURM_STEP_TASKS_PER_NODE": "1"}  # fmt: skip
    placement = detect(environ).placement()
    assert placement.nnodes.value == NodeRange(1, 1) and placement.hosts == ("gpu09",)


def test_slurm_array_task_names_the_rendezvous():
    placement = detect({**SLURM_STEP, "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "3"}).placement()
    assert placement.rdzv_id.value == "slurm-4200_3"


def test_slurm_gpus_give_the_processes_per_node():
    placement = detect({**SLURM_STEP, "SLURM_GPUS_ON_NODE": "4"}).placement()
    assert placement.nproc_per_node.value == 4


def test_slurm_batch_script_of_several_nodes_is_refused_with_the_srun_line():
    environ = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(SettingsRefused, match="outside srun") as refused:
        detect(environ).placement()
    assert "srun --ntasks-per-node=1 phalanx run" in refused.value.hint


def test_slurm_batch_script_of_one_node_is_fine():
    placement = detect({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n3", "SLURM_JOB_NUM_NODES": "1",
                        "SLURM_NTASKS_PER_NODE": "8"}).placement()  # fmt: skip
    assert placement.nnodes.value == NodeRange(1, 1) and placement.environment.endswith("(batch script) on n3")


def test_two_tasks_per_node_are_refused_with_the_right_srun_line():
    with pytest.raises(SettingsRefused) as refused:
        detect({**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4"}).placement()
    assert "SLURM_STEP_TASKS_PER_NODE=2(x2)" in refused.value.what
    assert refused.value.hint == "srun --nodes=2 --ntasks-per-node=1 phalanx run --nproc-per-node 2 [options] SCRIPT"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"SLURM_STEP_NODELIST": "gpu[07-08"}, "does not parse: a '[' is never closed"),
        ({"SLURM_STEP_NUM_NODES": "3"}, "names 2 host(s)"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 with 2 node(s) in SLURM_STEP_NODELIST=gpu[07-08]"),
        ({"SLURM_NODEID": "x"}, "SLURM_NODEID=x does not parse"),
        ({"SLURM_STEP_TASKS_PER_NODE": "lots"}, "SLURM_STEP_TASKS_PER_NODE=lots does not parse"),
    ],
)
def test_slurm_variables_that_cannot_be_right_are_refused(change, words):
    with pytest.raises(SettingsRefused) as refused:
        detect({**SLURM_STEP, **change}).placement()
    assert words in refused.value.what and refused.value.hint


def test_tasks_per_node_grammar():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]


def test_trainjob_pod_reads_the_pet_variables():
    environment = detect(TRAINJOB)
    assert isinstance(environment, TorchrunVariables)  # its JOB_COMPLETION_INDEX is the same fact again
    placement = environment.placement()
    assert placement.nnodes.value == NodeRange(2, 2) and placement.node_rank.value == 1
    assert placement.endpoint.value == Endpoint("mnist-node-0-0.mnist", 29400)
    assert placement.nproc_per_node.value == "auto" and placement.dns_may_lag


def test_issue_example_of_pet_variables():
    placement = detect({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.1.1.1",
                        "PET_MASTER_PORT": "29500", "PET_NPROC_PER_NODE": "2"}).placement()  # fmt: skip
    assert placement.endpoint.value == Endpoint("10.1.1.1", 29500) and placement.nproc_per_node.value == 2


def test_elastic_pytorchjob_gives_a_rendezvous_endpoint():
    placement = detect(
        {"PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_NNODES": "1:4", "PET_RDZV_ID": "j1"}
    ).placement()
    assert placement.endpoint.value == Endpoint("job-worker-0", 23456)
    assert placement.nnodes.value == NodeRange(1, 4) and placement.rdzv_id.value == "j1"


@pytest.mark.parametrize(
    ("environ", "pods"),
    [(PYTORCHJOB_V17, "PET_NNODES=2"), (PYTORCHJOB_V16, "WORLD_SIZE=2 (pods, as up to v1.6)")],
)
def test_pytorchjob_both_meanings_of_world_size(environ, pods):
    environment = detect(environ)
    assert isinstance(environment, PyTorchJob)
    placement = environment.placement()
    assert placement.nnodes.value == NodeRange(2, 2) and placement.nnodes.source == pods
    assert placement.node_rank.value == 1
    assert placement.endpoint.value == Endpoint("mnist-master-0", 23456)
    assert placement.rdzv_id.value == "mnist"


def test_pytorchjob_world_size_that_fits_neither_meaning_is_refused():
    with pytest.raises(SettingsRefused, match="neither the pod count"):
        detect({**PYTORCHJOB_V17, "WORLD_SIZE": "3"}).placement()


def test_indexed_job_with_its_headless_service():
    environ = {"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "train-2", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    environment = detect(environ, headless_service="train-svc")
    assert isinstance(environment, IndexedJob)
    placement = environment.placement()
    assert placement.node_rank.value == 2 and placement.nnodes is None
    assert placement.endpoint.value == Endpoint("train-0.train-svc", 29400)
    assert placement.rdzv_id.value == "train" and placement.dns_may_lag


def test_indexed_job_without_a_service_has_no_endpoint():
    placement = detect({"JOB_COMPLETION_INDEX": "0", "HOSTNAME": "train-0"}).placement()
    assert placement.endpoint is None


def test_skypilot():
    environment = detect(SKYPILOT)
    assert isinstance(environment, SkyPilot)
    placement = environment.placement()
    assert placement.hosts == ("10.0.0.5", "10.0.0.6") and placement.node_rank.value == 1
    assert placement.endpoint.value == Endpoint("10.0.0.5", 29400)
    assert placement.nproc_per_node.value == 8
    assert placement.rdzv_id.value == "sky-2026-12-03-10-00-00-000000_mycluster_1"


def test_skypilot_node_count_that_disagrees_with_the_addresses_is_refused():
    with pytest.raises(SettingsRefused, match="SKYPILOT_NODE_IPS names 2 host"):
        detect({**SKYPILOT, "SKYPILOT_NUM_NODES": "3"}).placement()


@pytest.mark.parametrize(
    ("environ", "bad"),
    [
        ({**TRAINJOB, "PET_NNODES": "two"}, "PET_NNODES=two"),
        ({**TRAINJOB, "PET_NPROC_PER_NODE": "many"}, "PET_NPROC_PER_NODE=many"),
        ({**TRAINJOB, "PET_NODE_RANK": "-1"}, "PET_NODE_RANK=-1"),
        ({**TRAINJOB, "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 with PET_NNODES=2"),
        ({**TRAINJOB, "PET_MASTER_PORT": "http"}, "PET_MASTER_PORT=http"),
    ],
)
def test_a_pet_value_that_does_not_parse_is_refused_naming_it(environ, bad):
    with pytest.raises(SettingsRefused) as refused:
        detect(environ).placement()
    assert bad in refused.value.what and refused.value.exit_code == 2


def test_slurm_and_kubeflow_variables_at_once_are_refused():
    with pytest.raises(SettingsRefused) as refused:
        detect({**SLURM_STEP, **TRAINJOB})
    assert "2 cluster environments" in refused.value.what
    assert "SLURM (SLURM_JOB_ID=4242" in refused.value.what and "PET_NNODES=2" in refused.value.what


@pytest.mark.parametrize(
    "environ",
    [{"TORCHELASTIC_RUN_ID": "abc", "RANK": "0", "LOCAL_RANK": "0"}, {"LOCAL_RANK": "1", "RANK": "3", **SLURM_STEP}],
)
def test_inside_a_torchrun_worker_is_refused(environ):
    with pytest.raises(SettingsRefused, match="inside a torchrun worker") as refused:
        detect(environ)
    assert "run the script directly" in refused.value.hint
