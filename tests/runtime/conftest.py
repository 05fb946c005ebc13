"""Fixtures the runtime tests share: `pages_back` checks that every test of a module whose
`server` fixture runs one instance gives every page back after its traffic."""

from __future__ import annotations

import pytest

from tests.servers import assert_all_pages_free


@pytest.fixture
def pages_back(server):
    """Every test's traffic gives every page back (use with `usefixtures`)."""
    yield
    assert_all_pages_free(server)
