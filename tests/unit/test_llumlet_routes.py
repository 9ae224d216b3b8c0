"""The llumlet's output routes: each request's reply subject, opened once and closed once."""

from __future__ import annotations

import pytest

from services.llumlet.routes import OutputRoutes


def test_a_route_opens_once_and_closes_once() -> None:
    routes = OutputRoutes()
    routes.open("r1", "gw.a")
    routes.open("r2", "gw.b")
    assert "r1" in routes and len(routes) == 2 and routes.subject("r1") == "gw.a"
    with pytest.raises(AssertionError):
        routes.open("r1", "gw.c")  # admitted or migrated in twice: a bug, not a new subject
    assert routes.close("r1") == "gw.a"
    assert routes.close("r1") is None and routes.subject("r1") is None and "r1" not in routes
    routes.open("r1", "gw.c")  # it may come back (migrated in again, or a new request of that id)
    assert sorted(routes.close_all()) == [("r1", "gw.c"), ("r2", "gw.b")]
    assert len(routes) == 0
