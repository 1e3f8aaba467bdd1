"""How this process loaded its configuration, so that a reload reads a new file the same way.

A key set by a command-line flag or a ``MOTOR_<SECTION>_<KEY>`` variable wins over the file at
start (flag > environment > file > default); a reload keeps that order, so a file sent to
``motor config reload``, or re-read on SIGHUP, is read with this process's own flags and
environment on top. Otherwise every key a flag or a variable sets (``motor up``'s ports, a
Kubernetes pod's environment) would read as a change, and the reload be refused.

``motor controller|coordinator|nodemanager`` records theirs at start (services/common/service_main.py);
a service built in-process (tests) has none, and reads a reload as the file alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from motor_mesh.common.config.loader import load
from motor_mesh.common.config.sections import Config


@dataclass(frozen=True)
class Source:
    section: str  # the service's own section: what a flat file holds, and what the flags set
    path: str | None  # --config; None: defaults only
    start: Config  # what was loaded at start
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # the flags given
    env: Mapping[str, str] = field(default_factory=dict)  # the MOTOR_* variables at start

    def load(self, text: str | None = None) -> Config:
        """The ``--config`` file, or ``text`` standing for a file, read as at start. Reads the
        file: call it off the event loop. Raises ConfigError."""
        return load(
            self.path if text is None else "config",
            section=self.section,
            env=self.env,
            overrides=self.overrides,
            text=text,
        )


def motor_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the loader reads (``MOTOR_<SECTION>_<KEY>``), and nothing else of the
    environment (which may hold secrets)."""
    return {k: v for k, v in environ.items() if k.startswith("MOTOR_")}


_recorded: Source | None = None


def record(source: Source) -> None:
    """This process's configuration, as ``service_main`` loaded it."""
    global _recorded
    _recorded = source


def recorded() -> Source | None:
    return _recorded
