"""``static_graph=True``: what the first synchronised backward fixes for every later one.

The first synchronised backward only counts the gradients each parameter
gets; the reducer reduces every bucket at its end (so reentrant
checkpointing, where gradients arrive inside a nested backward, and
parameters used several times both work), and the ranks agree on which
parameters some rank used. From then on a parameter is ready after as many
gradients as it got then, parameters unused then are ready at once (no
search for unused parameters), and a parameter that gets more, or fewer,
gradients raises torch's "training graph has changed" error at the end of
that backward, after every bucket went out, so ranks whose graph did not
change are not left hanging in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StaticGraph"]

WAIT, READY, OVER = 0, 1, 2
"""What :meth:`StaticGraph.count` says of a parameter's latest gradient."""


class StaticGraph:
    """The counts of the first synchronised backward, and this backward's departures from them."""

    def __init__(self) -> None:
        self.expected: list[int] | None = None
        """Gradients per parameter in the first synchronised backward (``None`` until it ends)."""
        self.used: list[bool] | None = None
        """Whether some rank used each parameter in the first synchronised backward."""
        self.overcounted: dict[int, int] = {}
        """This backward: parameters that got more gradients than in the first one (index: how many)."""

    @property
    def counted(self) -> bool:
        """Whether the first synchronised backward has been counted."""
        return self.expected is not None

    def reset(self) -> None:
        """A new backward begins."""
        self.overcounted = {}

    def count(self, index: int, hits: int) -> int:
        """Parameter ``index`` got its ``hits``-th gradient: :data:`WAIT` for more, :data:`READY`, or :data:`OVER`."""
        expected = self.expected[index]  # type: ignore[index]
        if hits > expected:
            self.overcounted.setdefault(index, hits)
            return OVER
        return READY if hits == expected else WAIT

    def first_done(self, hits: Sequence[int]) -> list[bool]:
        """The first synchronised backward ends with ``hits`` gradients per parameter: which were ready."""
        self.expected = list(hits)
        return [h > 0 for h in hits]

    def unused_in_first(self) -> list[int]:
        """Parameters that got no gradient in the first synchronised backward (ready at once later)."""
        return [i for i, n in enumerate(self.expected or ()) if n == 0]

    def unused_here(self) -> set[int]:
        """Parameters treated as unused in a later backward: none in the first, or no rank's."""
        unused = set(self.unused_in_first())
        unused.update(i for i, u in enumerate(self.used or ()) if not u)
        return unused

    def short(self, missing: Sequence[int]) -> list[int]:
        """Of ``missing`` (no gradient in this backward), those that got some in the first one."""
        return [i for i in missing if self.expected[i] > 0]  # type: ignore[index]

    def check(self, names: Sequence[str], hits: Sequence[int], short: Sequence[int]) -> None:
        """Raise if this backward departed from the first one (more or fewer gradients)."""
        if self.overcounted:
            index, got = next(iter(self.overcounted.items()))  # the first to get one gradient too many
            raise RuntimeError(
                f"DistributedDataParallel(static_graph=True): parameter {names[index]!r} got "
                f"gradient #{got} in this backward but {self.expected[index]} "  # type: ignore[index]
                "in the first one. Your "
                "training graph has changed in this iteration, e.g., one parameter is unused in first "
                "iteration, but then got used in this iteration. this is not compatible with "
                "static_graph set to True"
            )
        if short:
            named = ", ".join(f"{names[i]!r} ({hits[i]} of {self.expected[i]})" for i in short)  # type: ignore[index]
            raise RuntimeError(
                f"DistributedDataParallel(static_graph=True): fewer gradients than in the first "
                f"backward for {named}. Your training graph has changed in this iteration; "
                "static_graph=True needs the same graph every iteration"
            )

