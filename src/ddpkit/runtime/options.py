"""Config fields and the configuration error shared by every config dataclass (torch-free).

Each command's settings are one ``@dataclass(kw_only=True)`` (``TrainConfig``,
``LaunchConfig``, ``BenchConfig``, ...). A field made with :func:`option`
carries its command-line help, and ``ddpkit.cli`` generates the flag from it,
so the defaults and the validation live in the dataclass only.
"""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any

__all__ = ["ConfigError", "RunError", "option"]


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag, the value and the fix.

    The command line shows it as a usage error (exit code 2) without a
    traceback; any other exception keeps its traceback.
    """


class RunError(RuntimeError):
    """A run failed for a reason outside the program (a full disk at the final save); the message names what
    failed, the cause and what to do.

    The command line shows it as one line, ``ddpkit <cmd>: error: ...``, with
    exit code 1 (a worker's is re-raised so in the command that started it):
    a traceback would only hide the one line that matters.
    """


def option(default: Any = MISSING, help: str = "", *, factory: Any = None, **cli: Any) -> Any:
    """A config field with its command-line description.

    Args:
        default: the field's default (none: a required field).
        help: what ``--help`` shows for the flag.
        factory: a default factory instead of ``default`` (lists).
        **cli: how the flag is built: ``choices``; ``negate`` (the flag that
            sets a bool to False, e.g. ``"--no-progress"``; with
            ``negate_only=True`` only that flag exists); ``flags`` (the
            spellings, default ``--field-name`` and ``--field_name``);
            ``positional=True``; ``nargs``; ``metavar``; ``cli=False`` for a
            field with no flag.
    """
    metadata = {"help": help, **cli}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def writable_file(path: Any, flag: str) -> Any:
    """``path`` as a ``Path`` once it is clear a file can be written there, before any work starts.

    Raises:
        ConfigError: the path is a directory, its folder does not exist, or
            this process may not write there.
    """
    import os
    from pathlib import Path

    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory: give a file name")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: the folder {str(folder)!r} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {str(path)!r} cannot be written by this user: choose another path")
    return path


def plain(config: Any) -> dict[str, Any]:
    """A config dataclass as plain data (paths as strings), for JSON files and checkpoints."""
    from dataclasses import asdict
    from pathlib import Path

    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
