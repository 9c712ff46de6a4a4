"""phalanx run's settings inside a cluster environment: what it fills, what it refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.cli.main import build_parser
from phalanx.errors import SettingsRefused
from phalanx.launch.options import spec_from_args
from phalanx.settings.values import Endpoint, NodeRange
from tests.unit.test_clusters import SLURM_STEP, TRAINJOB


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def spec(argv, environ):
    return spec_from_args(build_parser().parse_args(["run", *argv]), environ)


def test_slurm_fills_the_node_count_endpoint_and_job_id(script):
    result = spec([script], SLURM_STEP)
    assert result.nnodes == NodeRange(2, 2)
    assert result.rdzv_endpoint.host == "gpu07" and result.rdzv_id == "slurm-4242"
    assert result.node_rank == 1 and result.endpoint_origin.startswith("the first host of SLURM_STEP_NODELIST")
    assert result.cluster_notes[0].startswith("SLURM job 4242 (step 0) on gpu[07-08]: node 1 of 2")


def test_pet_variables_as_the_issue_reported_them(script):
    environ = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.1.1.1", "PET_MASTER_PORT": "29500",
               "PET_NPROC_PER_NODE": "2"}  # fmt: skip
    result = spec(["--dry-run", script], environ)
    assert result.nnodes == NodeRange(2, 2) and result.nproc_per_node == 2
    assert result.rdzv_endpoint == Endpoint("10.1.1.1", 29500)


def test_flag_beats_pet_beats_phalanx_variable(script):
    environ = {"PET_MAX_RESTARTS": "3", "PHALANX_MAX_RESTARTS": "5", "PHALANX_BACKEND": "gloo"}
    assert spec([script], environ).max_restarts == 3
    assert spec(["--max-restarts", "1", script], environ).max_restarts == 1


@pytest.mark.parametrize(
    ("argv", "environ", "row"),
    [
        (["--nnodes", "4"], SLURM_STEP, r"nnodes\s+4 \(--nnodes\)\s+2 \(SLURM_STEP_NUM_NODES=2\)"),
        (["--nnodes", "3"], TRAINJOB, r"nnodes\s+3 \(--nnodes\)\s+2 \(PET_NNODES=2\)"),
        (["--standalone"], SLURM_STEP, r"standalone\s+1 node \(--standalone\)\s+2 \(SLURM_STEP_NUM_NODES=2\)"),
    ],
)
def test_a_node_count_that_contradicts_the_environment_is_refused_with_a_table(script, argv, environ, row):
    with pytest.raises(SettingsRefused) as refused:
        spec([*argv, script], environ)
    assert refused.value.what.startswith("the launch settings contradict the ")
    assert re.match(r"setting\s+you set\s+the environment says", refused.value.why), refused.value.why
    assert re.search(row, refused.value.why), refused.value.why
    assert refused.value.hint and refused.value.exit_code == 2


def test_the_same_node_count_as_the_environment_is_fine(script):
    assert spec(["--nnodes", "2", script], SLURM_STEP).nnodes == NodeRange(2, 2)


def test_a_user_endpoint_and_processes_beat_the_environment_and_are_noted(script):
    result = spec(["--rdzv-endpoint", "10.9.9.9:1234", "--nproc-per-node", "3", script],
                  {**SLURM_STEP, "SLURM_GPUS_ON_NODE": "4"})  # fmt: skip
    assert result.rdzv_endpoint == Endpoint("10.9.9.9", 1234) and result.nproc_per_node == 3
    assert result.node_rank is None and result.endpoint_origin is None  # the user's endpoint: host by address
    notes = "\n".join(result.cluster_notes)
    assert "rdzv-endpoint 10.9.9.9:1234 from --rdzv-endpoint, not gpu07" in notes
    assert "nproc-per-node 3 from --nproc-per-node, not 4 (SLURM_GPUS_ON_NODE=4)" in notes


def test_a_single_node_allocation_meets_on_a_free_port_as_without_slurm(script):
    result = spec([script], {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"})
    assert result.nnodes == NodeRange(1, 1) and result.rdzv_endpoint is None and result.rdzv_id == "slurm-9"


def test_env_init_variables_outside_a_scheduler_are_named_as_ignored(script):
    """MASTER_ADDR, RANK and WORLD_SIZE exported by hand (a habit from env:// launches) do not set
    the job up: the decision block says so, with the flags that do."""
    result = spec([script], {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"})
    assert result.nnodes == NodeRange(1, 1) and result.rdzv_endpoint is None
    (note,) = result.cluster_notes
    assert note.startswith("none detected; MASTER_ADDR=10.0.0.1, MASTER_PORT=29500, RANK=0, WORLD_SIZE=2 ignored")
    assert "--rdzv-endpoint HOST:PORT with --nnodes N" in note
    assert spec([script], {}).cluster_notes == ()


def test_simulated_nodes_ignore_the_environment_and_say_so(script):
    result = spec(["--simulate-nodes", "2", script], SLURM_STEP)
    assert result.simulate_nodes == 2 and result.rdzv_endpoint is None
    assert result.cluster_notes == ("SLURM detected and ignored: --simulate-nodes runs every node on this host",)


def test_indexed_job_needs_the_node_count_and_the_service(script):
    environ = {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "train-1"}
    with pytest.raises(SettingsRefused, match="JOB_COMPLETION_INDEX=1 .*but the job has 1 node") as refused:
        spec([script], environ)
    assert "the Job's completions" in refused.value.hint
    with pytest.raises(SettingsRefused, match="nothing says where they meet") as refused:
        spec(["--nnodes", "2", script], environ)
    assert "--headless-service" in refused.value.hint
    result = spec(["--nnodes", "2", "--headless-service", "train", script], environ)
    assert result.rdzv_endpoint == Endpoint("train-0.train", 29400) and result.node_rank == 1


def test_bad_headless_service_name_is_refused(script):
    with pytest.raises(SettingsRefused, match="not a Kubernetes Service name"):
        spec(["--headless-service", "Bad_Name", script], {})
