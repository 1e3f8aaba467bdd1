"""Files that grant rights (the management key, a TLS private key, client API keys): read, and
refused when others could read them."""

from __future__ import annotations

import os
import stat

from motor_mesh.common.config.errors import ConfigError

# gRPC's default limit for all metadata of a call is 8 KiB; the key travels in it.
_MAX_KEY_BYTES = 4096


def read_private_file(path: str, what: str, limit: int) -> bytes:
    """The content of ``path`` (at most ``limit`` bytes), refused unless it is a regular file
    that group and others cannot access: whoever can read it holds what it grants.

    ``what`` names the file in the one-line errors; errors never include the content.
    """
    try:
        # O_NONBLOCK: a FIFO must not hang start-up. fstat on the open file judges the file that
        # is read, not whatever the path names a moment later.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ConfigError(f"{path}: {what} is not a regular file")
            if mode & 0o077:
                raise ConfigError(f"{path}: {what} must not be readable by group or others (chmod 600)")
            with open(fd, "rb", closefd=False) as f:
                data = f.read(limit + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc.strerror or type(exc).__name__}") from None
    if len(data) > limit:
        raise ConfigError(f"{path}: {what} is larger than {limit} bytes")
    return data


def read_key_file(path: str) -> str:
    """The management key: the file's content without its trailing newline."""
    key = read_private_file(path, "key file", _MAX_KEY_BYTES).decode("latin-1").rstrip("\r\n")
    if not key:
        raise ConfigError(f"{path}: key file is empty")
    if not all(" " <= c <= "~" for c in key):  # it is sent as gRPC metadata: printable ASCII only
        raise ConfigError(f"{path}: key file must hold printable ASCII only")
    return key
