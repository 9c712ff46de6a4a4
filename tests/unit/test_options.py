"""Where settings come from: flag > PHALANX_* variable > --config file > default."""

from pathlib import Path

import pytest

from phalanx.cli.main import build_parser
from phalanx.errors import SettingsRefused
from phalanx.launch.options import spec_from_args
from phalanx.settings.options import LAUNCH_OPTIONS
from phalanx.settings.values import Endpoint, NodeRange


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def spec(argv, environ=None):
    return spec_from_args(build_parser().parse_args(["run", *argv]), environ or {})


def test_defaults(script):
    result = spec([script])
    assert result.nnodes == NodeRange(1, 1) and result.nproc_per_node == 1 and result.backend == "auto"
    assert result.rdzv_endpoint is None and result.max_restarts == 0


def test_script_arguments_pass_through_untouched(script):
    result = spec(["--nproc-per-node", "2", script, "--nnodes", "7", "-m", "x", "--", "y"])
    assert result.nproc_per_node == 2 and result.nnodes == NodeRange(1, 1)
    assert result.entrypoint.args == ("--nnodes", "7", "-m", "x", "--", "y")


def test_module_mode():
    result = spec(["-m", "json.tool", "--sort-keys"])
    assert result.entrypoint.is_module and result.entrypoint.target == "json.tool"
    assert result.entrypoint.args == ("--sort-keys",)


def test_torchrun_underscore_spelling(script):
    assert spec(["--nproc_per_node", "3", script]).nproc_per_node == 3


def test_every_flag_has_an_environment_variable(script):
    names = {option.env_var for option in LAUNCH_OPTIONS}
    assert {
        "PHALANX_NNODES",
        "PHALANX_NPROC_PER_NODE",
        "PHALANX_RDZV_ENDPOINT",
        "PHALANX_SIMULATE_NODES",
        "PHALANX_DRY_RUN",
    } <= names
    result = spec([script], {"PHALANX_NPROC_PER_NODE": "3", "PHALANX_DRY_RUN": "1", "PHALANX_BACKEND": "gloo"})
    assert result.nproc_per_node == 3 and result.dry_run and result.backend == "gloo"


def test_precedence_flag_over_env_over_config(tmp_path, script):
    config = tmp_path / "phalanx.toml"
    config.write_text('nproc-per-node = 4\nmax_restarts = 2\nrdzv-endpoint = "10.0.0.1:1234"\nnnodes = "2"\n')
    environ = {"PHALANX_MAX_RESTARTS": "5"}
    result = spec(["--config", str(config), "--nproc-per-node", "1", script], environ)
    assert result.nproc_per_node == 1  # flag beats config
    assert result.max_restarts == 5  # env beats config
    assert result.rdzv_endpoint == Endpoint("10.0.0.1", 1234)  # config beats default
    assert result.nnodes == NodeRange(2, 2)


def test_config_under_a_run_table_and_from_env(tmp_path, script):
    config = tmp_path / "c.toml"
    config.write_text("[run]\nnproc_per_node = 2\n")
    assert spec([script], {"PHALANX_CONFIG": str(config)}).nproc_per_node == 2


def test_bad_environment_value_names_the_variable(script):
    with pytest.raises(SettingsRefused) as refused:
        spec([script], {"PHALANX_NNODES": "two"})
    assert "PHALANX_NNODES" in refused.value.what


def test_bad_config(tmp_path, script):
    config = tmp_path / "c.toml"
    config.write_text("nprocs = 2\n")
    with pytest.raises(SettingsRefused, match="unknown setting 'nprocs'"):
        spec(["--config", str(config), script])
    config.write_text("nnodes = [\n")
    with pytest.raises(SettingsRefused, match="not valid TOML"):
        spec(["--config", str(config), script])
    with pytest.raises(SettingsRefused, match="does not exist"):
        spec(["--config", str(tmp_path / "missing.toml"), script])


def test_no_script():
    with pytest.raises(SettingsRefused, match="no training script"):
        spec(["--nproc-per-node", "2"])
