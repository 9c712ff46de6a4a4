"""Every refusal of an impossible launch, with what its message says."""

from pathlib import Path

import pytest

from phalanx.errors import SettingsRefused
from phalanx.exit_codes import ExitCode
from phalanx.launch.spec import LaunchSpec
from phalanx.settings.entrypoint import Entrypoint
from phalanx.settings.values import Endpoint, NodeRange


@pytest.fixture
def script(tmp_path: Path) -> Entrypoint:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return Entrypoint(str(path), ("--lr", "0.1"))


def refusal(**kwargs) -> SettingsRefused:
    with pytest.raises(SettingsRefused) as refused:
        LaunchSpec(**kwargs)
    assert refused.value.exit_code == ExitCode.REFUSED == 2
    assert refused.value.hint, "every refusal says what to do"
    return refused.value


def test_a_sound_single_node_spec_is_accepted(script):
    spec = LaunchSpec(entrypoint=script, nproc_per_node=2)
    assert not spec.is_multi_node
    assert spec.entrypoint.args == ("--lr", "0.1")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.1.1", "::1"])
def test_loopback_endpoint_with_several_nodes(script, host):
    error = refusal(entrypoint=script, nnodes=NodeRange(2, 2), rdzv_endpoint=Endpoint(host, 29400))
    assert "loopback" in error.what and "--nnodes is 2" in error.what
    assert "--simulate-nodes 2" in error.hint


def test_loopback_endpoint_is_fine_when_simulated(script):
    spec = LaunchSpec(entrypoint=script, simulate_nodes=2, rdzv_endpoint=Endpoint("127.0.0.1", 29400))
    assert spec.simulate_nodes == 2


def test_standalone_with_several_nodes(script):
    error = refusal(entrypoint=script, nnodes=NodeRange(2, 2), standalone=True, rdzv_endpoint=Endpoint("10.0.0.1", 1))
    assert "--standalone with --nnodes 2" in error.what
    assert "--rdzv-endpoint" in error.hint


def test_several_nodes_need_an_endpoint(script):
    error = refusal(entrypoint=script, nnodes=NodeRange(1, 3))
    assert "without --rdzv-endpoint" in error.what


def test_simulation_conflicts(script):
    assert "--nnodes" in refusal(entrypoint=script, simulate_nodes=2, nnodes=NodeRange(3, 3)).what
    assert "--standalone" in refusal(entrypoint=script, simulate_nodes=2, standalone=True).what
    error = refusal(entrypoint=script, simulate_nodes=2, rdzv_endpoint=Endpoint("10.0.0.1", 29400))
    assert "loopback" in error.why


def test_missing_script(tmp_path):
    error = refusal(entrypoint=Entrypoint(str(tmp_path / "nope.py")))
    assert "does not exist" in error.what and "nope.py" in error.what


def test_folder_instead_of_script(tmp_path):
    assert "is a folder" in refusal(entrypoint=Entrypoint(str(tmp_path))).what


def test_missing_module():
    error = refusal(entrypoint=Entrypoint("no_such_package_xyz.train", is_module=True))
    assert "cannot be found" in error.what


def test_existing_module_is_accepted():
    assert LaunchSpec(entrypoint=Entrypoint("json.tool", is_module=True)).entrypoint.source_file().name == "tool.py"
