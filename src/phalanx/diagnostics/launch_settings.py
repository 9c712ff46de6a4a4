"""The launch settings `phalanx run` would use on this machine, and where each one comes from.

A setting comes from ``PET_<FLAG>``, else ``PHALANX_<FLAG>``, else the ``--config`` file, else
:class:`LaunchSpec`'s default, each through :func:`phalanx.settings.options.resolve_settings` as
`phalanx run` does. A value run would refuse is reported with its refusal, not raised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import SettingsRefused
from phalanx.launch.spec import LaunchSpec
from phalanx.settings.options import LAUNCH_OPTIONS, resolve_settings

#: A setting's value as JSON holds it: numbers and switches as they are, the rest as text.
JsonValue = str | int | float | bool | None


@dataclass(frozen=True)
class ResolvedSetting:
    flag: str  # e.g. "nproc-per-node"
    value: JsonValue  # the typed value; the raw text when refused
    source: str  # "environment", "config" or "default"
    origin: str  # the variable's name, the config file's path, or "LaunchSpec default"
    refused: str | None = None  # why `phalanx run` would refuse the value (None: it is fine)
    hint: str | None = None


def resolved_settings(
    environ: Mapping[str, str], config: Mapping[str, object], config_path: Path | None
) -> list[ResolvedSetting]:
    defaults = {field.name: field.default for field in dataclasses.fields(LaunchSpec)}
    settings = []
    for option in LAUNCH_OPTIONS:
        # One option at a time, so a value run would refuse is reported next to the others.
        variable = next((v for v in (option.torchrun_var, option.env_var) if v is not None and v in environ), None)
        from_env = {variable: environ[variable]} if variable is not None else {}
        from_config = {option.field: config[option.field]} if option.field in config else {}
        if from_env:
            source, origin, raw = "environment", variable, from_env[variable]
        elif from_config:
            source, origin, raw = "config", str(config_path), from_config[option.field]
        else:
            default = json_value(defaults[option.field])
            settings.append(ResolvedSetting(option.flag, default, "default", "LaunchSpec default"))
            continue
        try:
            value = resolve_settings({}, from_env, from_config, config_path)[option.field].value
            settings.append(ResolvedSetting(option.flag, json_value(value), source, origin))
        except SettingsRefused as refused:
            settings.append(ResolvedSetting(option.flag, json_value(raw), source, origin, refused.what, refused.hint))
    return settings


def json_value(value: object) -> JsonValue:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # NodeRange "2:4", Endpoint "10.0.0.1:29400", Path
