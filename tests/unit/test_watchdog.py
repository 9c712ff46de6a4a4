"""The stall watchdog says when it cannot work, instead of silently never firing, and refuses a
stall timeout that is not a positive number of seconds.

A flight recorder switched on or off is real (a gloo group of one rank in a process of its own:
torch reads the switch when the group is made). A torch without this flight recorder cannot be
installed beside the one tested here; it is stood in for by removing the function."""

from __future__ import annotations

import sys

import pytest
import torch

from phalanx.errors import SettingsRefused
from phalanx.runtime.watchdog import stall_timeout_from_env, watchdog_unavailable
from tests.conftest import run_command

PROBE = """
import sys
import torch.distributed as dist
from phalanx.runtime.watchdog import watchdog_unavailable
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
dist.barrier()  # as phalanx.init does
print(watchdog_unavailable("gloo", 300) or "available")
dist.destroy_process_group()
"""


def probe(tmp_path, buffer_size: str) -> str:
    env = {"TORCH_FR_BUFFER_SIZE": buffer_size}
    result = run_command([sys.executable, "-c", PROBE, str(tmp_path / "store")], timeout=60, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.output
    return result.stdout.strip()


def test_the_watchdog_is_available_when_the_flight_recorder_records(tmp_path):
    assert probe(tmp_path, "500") == "available"


def test_a_flight_recorder_switched_off_is_named_with_a_hint(tmp_path):
    notice = probe(tmp_path, "0")
    assert notice.startswith("phalanx: the stall watchdog is off: TORCH_FR_BUFFER_SIZE=0 switches off torch's flight recorder")
    assert "until the backend's timeout (300 s), and no report names it" in notice
    assert notice.endswith("HINT: unset TORCH_FR_BUFFER_SIZE (phalanx sets 500)")


def test_a_torch_without_this_flight_recorder_is_named(monkeypatch):
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace")
    notice = watchdog_unavailable("gloo", 300)
    assert notice is not None and f"torch {torch.__version__} cannot show its flight recorder (AttributeError" in notice
    assert "HINT: use a torch whose flight recorder records gloo collectives" in notice



@pytest.mark.parametrize(("argument", "variable", "says"), [
    (None, "-5", "PHALANX_STALL_TIMEOUT='-5'\n  a stall timeout must be a positive number of seconds"),
    (None, "5m", "PHALANX_STALL_TIMEOUT='5m'\n  it is not a number of seconds"),
    (0, None, "stall_timeout=0\n  a stall timeout must be a positive number of seconds"),
    (float("nan"), None, "stall_timeout=nan"),
])  # fmt: skip
def test_a_stall_timeout_that_is_not_positive_seconds_is_refused_with_a_hint(monkeypatch, argument, variable, says):
    if variable is None:
        monkeypatch.delenv("PHALANX_STALL_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("PHALANX_STALL_TIMEOUT", variable)
    with pytest.raises(SettingsRefused) as refused:
        stall_timeout_from_env(argument)
    assert refused.value.exit_code == 2 and says in str(refused.value)
    assert "HINT: give the seconds a collective may stay pending before the job is aborted, for example 300" in str(refused.value)


def test_the_stall_timeout_comes_from_the_argument_then_the_variable_then_the_default(monkeypatch):
    monkeypatch.setenv("PHALANX_STALL_TIMEOUT", "42.5")
    assert stall_timeout_from_env(7) == 7.0 and stall_timeout_from_env(None) == 42.5
    monkeypatch.delenv("PHALANX_STALL_TIMEOUT")
    assert stall_timeout_from_env(None) == 300.0
