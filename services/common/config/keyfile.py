"""The management key file: read, and refused when others could read it."""

from __future__ import annotations

import os
import stat

from .errors import ConfigError

# gRPC's default limit for all metadata of a call is 8 KiB; the key travels in it.
_MAX_KEY_BYTES = 4096


def read_key_file(path: str) -> str:
    """The management key: the file's content without its trailing newline.

    Refuses a file that group or others can access, since the key grants management rights.
    Errors never include the content.
    """
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # checked before open(): a FIFO would block
            raise ConfigError(f"{path}: key file is not a regular file")
        if info.st_mode & 0o077:
            raise ConfigError(f"{path}: key file must not be readable by group or others (chmod 600)")
        with open(path, "rb") as f:
            data = f.read(_MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read key file: {exc.strerror or type(exc).__name__}") from None
    if len(data) > _MAX_KEY_BYTES:
        raise ConfigError(f"{path}: key file is larger than {_MAX_KEY_BYTES} bytes")
    key = data.decode("latin-1").rstrip("\r\n")
    if not key:
        raise ConfigError(f"{path}: key file is empty")
    if not all(" " <= c <= "~" for c in key):  # it is sent as gRPC metadata: printable ASCII only
        raise ConfigError(f"{path}: key file must hold printable ASCII only")
    return key
