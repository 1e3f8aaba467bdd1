"""The shared foreground entry point of ``motor controller|coordinator|nodemanager``.

Parses ``--config`` and the few flags that override config keys, loads the configuration
(printing every error and exiting 1 before anything binds), sets up logging, then runs the
service's ``serve(cfg, stop)`` coroutine until SIGTERM/SIGINT (a second one exits at once, and
under ``motor up`` stdin closing stops it too: :func:`motor_mesh.common.server.run`). SIGHUP
re-reads the ``--config`` file the same way (services/common/sighup.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from motor_mesh.common import log, sighup
from motor_mesh.common.config import Config, ConfigError, load
from motor_mesh.common.config.source import Source, motor_env, record
from motor_mesh.common.server import run

Serve = Callable[[Config, Any], Awaitable[int]]


def service_main(
    section: str,
    argv: list[str],
    serve: Serve,
    flags: dict[str, tuple[str, type]] | None = None,
    *,
    fast_loop: bool = False,
) -> int:
    """``flags`` maps extra CLI flags to config keys: ``{"--port": ("port", int)}``."""
    parser = argparse.ArgumentParser(prog=f"motor {section}", description=f"Run the Motor {section}.")
    parser.add_argument("--config", metavar="FILE", help="JSON config file (sectioned or flat)")
    parser.add_argument("--host", help=f"listen address (config {section}.host)")
    flags = {"--port": ("port", int), **(flags or {})}
    for flag, (key, typ) in flags.items():
        parser.add_argument(flag, type=typ, dest=key, help=f"config {section}.{key}")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    env = motor_env(os.environ)  # what a reload applies again (config/source.py)
    try:
        cfg = load(args.config, section=section, env=env, overrides={section: overrides})
    except ConfigError as err:
        for line in err.errors:
            print(line, file=sys.stderr)
        return 1
    log.setup(section, cfg.section(section).log_format, cfg.section(section).log_level)
    source = Source(section, args.config, cfg, overrides={section: overrides}, env=env)
    record(source)
    try:
        return run(lambda stop: sighup.serving(source, serve(cfg, stop)), fast_loop=fast_loop)
    except (OSError, ConfigError) as err:
        msg = "; ".join(err.errors) if isinstance(err, ConfigError) else str(err)
        log.error("start_failed", reason=msg)
        print(f"motor {section}: {msg}", file=sys.stderr)
        return 1
