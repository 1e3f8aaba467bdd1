"""Configuration: one JSON file, ``MOTOR_<SECTION>_<KEY>`` environment variables, CLI flags.

``load()`` gives typed sections (:mod:`.sections`), which is what services read;
``load_config()`` gives the same values as plain dicts (what ``motor config check`` and the
sample file are about). ``docs/configuration.md`` lists every key.
"""

from motor_mesh.common.config.errors import ConfigError
from motor_mesh.common.config.keyfile import read_key_file, read_private_file
from motor_mesh.common.config.loader import DEFAULTS, from_dicts, load, load_config
from motor_mesh.common.config.sections import (
    SECTIONS,
    Config,
    ControllerConfig,
    CoordinatorConfig,
    EngineConfig,
    NodeManagerConfig,
    Parallel,
    Planner,
    RateLimit,
    ServerConfig,
)

__all__ = [
    "DEFAULTS",
    "SECTIONS",
    "Config",
    "ConfigError",
    "ControllerConfig",
    "CoordinatorConfig",
    "EngineConfig",
    "NodeManagerConfig",
    "Parallel",
    "Planner",
    "RateLimit",
    "ServerConfig",
    "from_dicts",
    "load",
    "load_config",
    "read_key_file",
    "read_private_file",
]
