"""A worker's failure as its parent sees it: :class:`WorkerError`, and the report a failing child sends home."""

from __future__ import annotations

import pickle
import time
import traceback

__all__ = ["WorkerError", "encode_failure"]


class WorkerError(RuntimeError):
    """A worker process failed; carries its rank, exit code and traceback text.

    When the worker's exception could be pickled it is chained as
    ``__cause__``, so ``except`` clauses can still inspect the original.
    """

    def __init__(self, rank: int, message: str, traceback_text: str = "", exitcode: int | None = None,
                 who: str | None = None):
        self.rank = rank
        self.traceback = traceback_text
        self.exitcode = exitcode
        who = who or f"rank {rank}"
        self.who = who
        """``rank N``, or ``parameter server K``."""
        detail = f"\n\n--- traceback of {who} ---\n{traceback_text}" if traceback_text else ""
        super().__init__(f"{who} failed: {message}{detail}")

    @property
    def error_index(self) -> int:
        """The rank, by the name torch's ``ProcessException`` gives it."""
        return self.rank

    @property
    def exit_code(self) -> int | None:
        """The exit code, by the name torch's ``ProcessExitedException`` gives it (negative: killed by that
        signal)."""
        return self.exitcode


def encode_failure(exc: BaseException) -> tuple[float, str, str, bytes | None]:
    """What a failing child sends home: when, the exception in a line, its traceback, the exception pickled."""
    try:
        payload: bytes | None = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
        payload = None
    # The time lets the parent tell the root cause from the ranks that failed
    # only because it did (their collectives broke a moment later).
    return time.time(), f"{type(exc).__name__}: {exc}", traceback.format_exc(), payload

