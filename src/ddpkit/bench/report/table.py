"""How every table of ``ddpkit bench`` fits a terminal: its width, and notes wrapped to it."""

from __future__ import annotations

import textwrap

WIDTH = 100
"""Columns of every line of the tables and their notes (a terminal's, or a pasted log's)."""


def note_lines(text: str) -> list[str]:
    """``text`` as lines of at most :data:`WIDTH` columns, words kept whole."""
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False)
