"""The one exception configuration loading raises."""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(Exception):
    """One or more configuration problems; ``errors`` holds one formatted line per problem."""

    def __init__(self, errors: Iterable[str] | str) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))
