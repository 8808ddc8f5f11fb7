"""Timeouts follow this host's measured speed (tests/support/host_speed.py): one
calibration per run, kept in the environment, applied to the shared waits and to every
test's pytest-timeout (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
from host_speed import MAX_SLOWDOWN, SLOWDOWN_ENV, measure, scaled, slowdown


def test_the_run_measures_the_host_once_and_keeps_the_figure() -> None:
    factor = slowdown()
    assert 1.0 <= factor <= MAX_SLOWDOWN
    assert os.environ[SLOWDOWN_ENV]  # the servers a run starts inherit it
    assert slowdown() == factor  # not measured again
    assert scaled(10.0) == pytest.approx(10.0 * factor)
    assert measure(repeats=1) > 0


def test_a_given_figure_is_kept_within_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOWDOWN_ENV, "0.2")  # never shorter than the reference's timeouts
    assert slowdown() == 1.0
    monkeypatch.setenv(SLOWDOWN_ENV, "1000")
    assert slowdown() == MAX_SLOWDOWN
    monkeypatch.setenv(SLOWDOWN_ENV, "2.5")
    assert scaled(4.0) == 10.0


@pytest.mark.timeout(7)
def test_a_tests_timeout_is_scaled_to_this_host(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("timeout")
    assert marker.args[0] == pytest.approx(7 * slowdown())
