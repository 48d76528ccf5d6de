"""How every ``sluice`` command group is made, so they all read alike."""

from __future__ import annotations

from typing import Any

import typer


def command_group(help: str, **options: Any) -> typer.Typer:
    """A Typer group that shows its help when called bare, in click's plain layout: it wraps at the
    terminal's width, where Typer's rich table cut long flags (``--workers-per-mo…`` at 80 columns)."""
    return typer.Typer(help=help, no_args_is_help=True, rich_markup_mode=None, **options)
