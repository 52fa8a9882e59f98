"""Unit tests cannot start Ray, nor borrow the session's cluster."""

from __future__ import annotations

import pytest

from tests.unit.conftest import RayInUnitTest


def test_ray_init_fails_in_a_unit_test() -> None:
    import ray

    with pytest.raises(RayInUnitTest, match="tests/ray"):
        ray.init()


def test_the_shared_cluster_fixtures_fail_in_a_unit_test(request: pytest.FixtureRequest) -> None:
    for name in ("ray_session", "namespace"):
        with pytest.raises(RayInUnitTest):
            request.getfixturevalue(name)
