"""Database URLs as users write them reach the driver loraplex installs (psycopg2) when psycopg 3 is absent."""

from __future__ import annotations

import importlib.util

import pytest

from loraplex.platform.db import normalize_url


@pytest.mark.parametrize("url", [
    "postgresql://u@h:5432/db", "postgres://u@h:5432/db", "postgresql+psycopg://u@h:5432/db",
])
def test_postgres_urls_use_the_installed_driver(monkeypatch, url):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else real(name, *a))
    assert normalize_url(url) == "postgresql+psycopg2://u@h:5432/db"


def test_psycopg3_urls_are_kept_where_it_is_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert normalize_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgresql://u@h/db") == "postgresql://u@h/db"


@pytest.mark.parametrize("url", ["sqlite:///x.db", "postgresql+psycopg2://u@h/db", "mysql+pymysql://u@h/db"])
def test_other_urls_are_left_alone(url):
    assert normalize_url(url) == url
