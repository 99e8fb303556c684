"""The suite's own distribution over pytest-xdist workers: ``--dist loadgroup`` (pyproject's
addopts) must keep each xdist_group on one worker, or every module fixture that conftest groups
(tensor parallelism's subprocess, the engines a module shares) is built on each worker, and
the suite runs 10-20% longer without a failure (678-731 s against 595-604 s of pytest from a
fresh clone, 2026-12-06). xdist tells its scheduler a test's group through the test's node id
("...@group"); pytest 9.2 no longer takes that change (pytest-dev/pytest-xdist#1386), hence
the test extra's pytest<9.2. This test makes the breakage a failure instead of a slowdown."""

from __future__ import annotations

import pytest

GROUP = "suite_distribution"
pytestmark = pytest.mark.xdist_group(GROUP)


def test_an_xdist_group_reaches_the_scheduler(request):
    config = request.config
    # A worker's own "dist" is "no"; xdist keeps the controller's choice as "loadgroup".
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        pytest.skip("not run by xdist with --dist loadgroup")
    assert request.node.nodeid.endswith(f"@{GROUP}"), (
        f"{request.node.nodeid!r}: the xdist_group mark did not reach xdist's loadgroup "
        f"scheduler (pytest {pytest.__version__}): the groups are spread over the workers"
    )
