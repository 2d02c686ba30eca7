"""The ``ftmesh`` command line."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from .main import run

    return run(argv)
