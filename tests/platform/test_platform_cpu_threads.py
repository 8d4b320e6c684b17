"""The OpenMP idle policy a serving process sets before torch loads."""

from __future__ import annotations

import logging

from loraplex.platform.cpu_threads import prefer_passive_openmp


def test_sets_passive_when_nothing_chose_a_policy():
    env: dict[str, str] = {"PATH": "/bin"}
    assert prefer_passive_openmp(env, modules={}) is True
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_leaves_an_operators_choice_alone():
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        assert prefer_passive_openmp(env, modules={}) is False
        assert env == chosen


def test_too_late_once_torch_is_loaded(caplog):
    env: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="loraplex.platform.cpu_threads"):
        assert prefer_passive_openmp(env, modules={"torch": object()}) is False
    assert "OMP_WAIT_POLICY" not in env
    assert "imported before" in caplog.text
