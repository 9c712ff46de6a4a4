"""The launch settings `phalanx run` would use on this machine, and where each one comes from.

A setting comes from ``PET_<FLAG>``, else ``PHALANX_<FLAG>``, else the ``--config`` file, each
through :func:`phalanx.settings.options.resolve_settings` as `phalanx run` does; what they leave
unset, from the cluster environment where one is detected (through the same merge as `phalanx
run`'s), else :class:`LaunchSpec`'s default. A value run would refuse is reported with its
refusal, not raised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import SettingsRefused
from phalanx.launch.cluster import PLACEMENT_SETTINGS, with_cluster_environment
from phalanx.launch.spec import LaunchSpec
from phalanx.settings.options import LAUNCH_OPTIONS, resolve_settings
from phalanx.settings.values import Resolved

#: A setting's value as JSON holds it: numbers and switches as they are, the rest as text.
JsonValue = str | int | float | bool | None


@dataclass(frozen=True)
class ResolvedSetting:
    flag: str  # e.g. "nproc-per-node"
    value: JsonValue  # the typed value; the raw text when refused
    source: str  # "environment", "config", "cluster" or "default"
    origin: str  # the variable's name, the config file's path, the cluster's variables, or "LaunchSpec default"
    refused: str | None = None  # why `phalanx run` would refuse the value (None: it is fine)
    hint: str | None = None


def resolved_settings(
    environ: Mapping[str, str], config: Mapping[str, object], config_path: Path | None
) -> list[ResolvedSetting]:
    defaults = {field.name: field.default for field in dataclasses.fields(LaunchSpec)}
    given: dict[str, Resolved] = {}
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
            given[option.field] = resolve_settings({}, from_env, from_config, config_path)[option.field]
            settings.append(ResolvedSetting(option.flag, json_value(given[option.field].value), source, origin))
        except SettingsRefused as refused:
            settings.append(ResolvedSetting(option.flag, json_value(raw), source, origin, refused.what, refused.hint))
    from_cluster = _from_cluster(given, environ)
    return [
        dataclasses.replace(setting, value=from_cluster[setting.flag][0], source="cluster", origin=from_cluster[setting.flag][1])
        if setting.source == "default" and setting.flag in from_cluster else setting
        for setting in settings
    ]  # fmt: skip


def _from_cluster(given: Mapping[str, Resolved], environ: Mapping[str, str]) -> dict[str, tuple[JsonValue, str]]:
    """flag -> (value, its variables) for the settings the cluster environment fills; none where
    there is no environment or `phalanx run` would refuse it (the report's cluster section says why)."""
    try:
        merged = with_cluster_environment(given, environ)
    except SettingsRefused:
        return {}
    placement = merged.get("placement")
    found = {}
    for name, attribute in PLACEMENT_SETTINGS:
        item = getattr(placement, attribute, None)
        if item is not None and name not in given and merged.get(name) == item.value:
            found[name.replace("_", "-")] = (json_value(item.value), item.source)
    return found


def json_value(value: object) -> JsonValue:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # NodeRange "2:4", Endpoint "10.0.0.1:29400", Path
