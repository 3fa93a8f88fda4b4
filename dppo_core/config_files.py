"""Configuration files: reading a YAML config, resolving its ``base: PRESET``, and the presets the package
ships.

Torch-free, and below :mod:`dppo_core.config`, which builds a :class:`~dppo_core.config.DPPOConfig` from what
these functions read (:meth:`~dppo_core.config.DPPOConfig.from_yaml`, :func:`~dppo_core.config.preset`).
:func:`preset_names` is importable from :mod:`dppo_core.config` too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dppo_core.config_checks import ConfigError

#: The presets shipped with the package, one ``NAME.yaml`` each.
PRESETS_DIR = Path(__file__).parent / "presets"

#: The YAML key naming the preset a file starts from (it is not a DPPOConfig field).
BASE_KEY = "base"


def preset_names() -> list[str]:
    """The names of the presets shipped with the package, sorted (``dppo train --preset NAME``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The file of preset ``name``; a :class:`ConfigError` naming the presets there are if it has none."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; choose one of {preset_names()} or pass --config FILE")
    return path


def resolve_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config file's fields with its ``base`` resolved: the base preset's fields (resolved the same
    way, recursively), then the file's own, which replace them. The result has no ``base`` key.

    An unknown base names the presets there are; a chain of bases that comes back to a file is a cycle.
    """
    path = Path(path)
    data = read_yaml_mapping(path)
    if BASE_KEY not in data:
        return data
    base = data.pop(BASE_KEY)
    chain = (*_chain, path.resolve())
    if not isinstance(base, str) or not (PRESETS_DIR / f"{base}.yaml").is_file():
        raise ConfigError(f"{path}: unknown base preset {base!r}; choose one of {preset_names()}")
    base_path = (PRESETS_DIR / f"{base}.yaml").resolve()
    if base_path in chain:
        cycle = " -> ".join(p.stem for p in (*chain[chain.index(base_path):], base_path))
        raise ConfigError(f"{path}: the base presets form a cycle ({cycle}); "
                          "one of them must not name a base")
    return {**resolve_yaml(base_path, chain), **data}


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """The mapping a YAML file holds, as written (``base`` unresolved); a :class:`ConfigError` for a missing
    file, invalid YAML or anything but a mapping."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a YAML file or use --preset NAME")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of field: value, got "
                          f"{type(data).__name__}")
    return data
