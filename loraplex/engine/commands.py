"""The engine's subcommands of `loraplex`."""

from __future__ import annotations

import click

from loraplex.engine.fetch import fetch


@click.group()
def model() -> None:
    """Fetch and inspect base models."""


model.add_command(fetch)
