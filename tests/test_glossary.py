"""The glossary of docs/architecture.md kept true: each term's name in the code exists, and the words it replaced are
gone (a replaced ``ddpkit.`` name no longer resolves; a replaced phrase is in no source, page or the README)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _rows() -> list[tuple[str, str, str, list[str]]]:
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Glossary\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else []
        if len(cells) != 4 or cells[0] in ("term", "---"):
            continue
        term, meaning, code, banned = cells
        rows.append((term, meaning, code.strip("`"), [b.strip().strip("`") for b in banned.split(";") if b.strip()]))
    return rows


ROWS = _rows()


def _resolve(dotted: str) -> object:
    """The object a dotted name names: a module's attribute, or a dataclass's field (by its type's fields)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, name in enumerate(parts[cut:]):
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)} \
                    and i == len(parts[cut:]) - 1:
                return dataclasses.fields(obj)[[f.name for f in dataclasses.fields(obj)].index(name)]
            else:
                raise AttributeError(f"{dotted}: {'.'.join(parts[:cut + i])} has no {name!r}")
        return obj
    raise ImportError(dotted)


def test_the_glossary_lists_the_words_that_had_several_meanings() -> None:
    terms = {term for term, *_ in ROWS}
    assert {"epoch", "generation", "bucket", "chunk", "join", "holder", "candidate", "fault tolerance"} <= terms


@pytest.mark.parametrize("term, meaning, code", [(t, m, c) for t, m, c, _ in ROWS], ids=[r[0] for r in ROWS])
def test_each_term_names_code_that_exists(term: str, meaning: str, code: str) -> None:
    _resolve(code)


def _texts() -> dict[Path, str]:
    files = [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md",
             ROOT / "mkdocs.yml"]
    texts = {p: p.read_text() for p in files}
    glossary = texts[ARCHITECTURE]
    texts[ARCHITECTURE] = glossary.split("\n## Glossary\n", 1)[0]  # the table itself names the old words
    return texts


@pytest.mark.parametrize("term, banned", [(t, b) for t, _, _, bs in ROWS for b in bs],
                         ids=[f"{t}: {b}" for t, _, _, bs in ROWS for b in bs])
def test_a_replaced_word_is_gone(term: str, banned: str) -> None:
    if banned.startswith("ddpkit."):
        with pytest.raises((AttributeError, ImportError)):
            _resolve(banned)
        return
    # Words may wrap across lines (and a Markdown link across two): compared with the whitespace runs as one space.
    pattern = re.compile(r"(?<!\w)" + r"\s+".join(map(re.escape, banned.split())) + r"(?!\w)")
    found = [str(p.relative_to(ROOT)) for p, text in _texts().items() if pattern.search(text)]
    assert not found, f"{banned!r} (now: {term}) is still in {found}"
