"""``loom loadtest WORKLOAD.yaml``: open-loop multi-tenant load against a running Loom (loadtest/)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from loadtest import loadtest_cli

    loadtest_cli.register(sub)
