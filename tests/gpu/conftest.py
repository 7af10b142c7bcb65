"""Every test under tests/gpu carries the ``gpu`` marker (``pytest -m gpu`` selects them)."""

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
