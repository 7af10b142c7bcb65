"""Named states and their moves: the one check every state machine of ddpkit makes before it moves.

Each state machine keeps its state as an :class:`enum.Enum` and the moves it allows as a table (a dict from each
state to the states it may go to), and changes its state in one function that calls :func:`check_move` first: the
gradient reducer's phase, stage 3's backward and a unit's residency, a council's role, a launcher's workers and its
node's standing. A move the table does not list is a bug, raised where it happens.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["check_move"]

State = TypeVar("State", bound=enum.Enum)


def check_move(moves: Mapping[State, frozenset[State]], now: State, to: State, who: str) -> None:
    """Raise :class:`RuntimeError` unless ``moves`` lets ``now`` go to ``to``; ``who`` names what moves."""
    if to not in moves[now]:
        raise RuntimeError(f"{who} has no move from {now.value} to {to.value} (a bug in ddpkit: please report it)")
