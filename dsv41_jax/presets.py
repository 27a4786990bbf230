"""Named configurations: the ml-collections files in the repository's ``configs/`` directory.

``configs/<name>.py`` defines ``get_config()``; its keys are :class:`dsv41_jax.ModelConfig` fields. The files are
data, not code forks: every preset builds the same validated ``ModelConfig``.
"""

from __future__ import annotations

import importlib.util
import os

from dsv41_jax.config import ConfigError, ModelConfig, YarnConfig

CONFIG_DIR = os.environ.get("DSV41_CONFIG_DIR") or os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


def available() -> list[str]:
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and not f.startswith("_"))


def from_config_dict(cd) -> ModelConfig:
    d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
    if isinstance(d.get("compress_yarn"), dict):
        d["compress_yarn"] = YarnConfig(**d["compress_yarn"])
    return ModelConfig.from_dict(d, strict=True)


def get(name: str, **overrides) -> ModelConfig:
    path = os.path.join(CONFIG_DIR, f"{name}.py")
    if not os.path.isdir(CONFIG_DIR):
        raise ConfigError(f"config presets not found: {CONFIG_DIR} does not exist (the presets live in the "
                          "repository's configs/: install with `pip install -e .` from a checkout, or set "
                          "DSV41_CONFIG_DIR; or pass a path to a config.json / checkpoint directory)")
    if not os.path.exists(path):
        raise ConfigError(f"unknown config {name!r}: no {path}; available: {available()} "
                          "(or pass a path to a config.json / checkpoint directory)")
    spec = importlib.util.spec_from_file_location(f"dsv41_configs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = from_config_dict(module.get_config())
    return config.replace(**overrides) if overrides else config
