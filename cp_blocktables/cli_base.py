"""What every subcommand's command-line module shares: the registry entry, the
usage error, positive numbers and sub-parsers of actions.

`cli.py` registers subcommands; each product keeps its own arguments and the
building of its options beside itself (`harness/cli_args.py`,
`drills/cli_args.py`, `bench/cli_args.py`) and exposes `Subcommand`s. This
module imports nothing of the package, so any product may import it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    """A subcommand or an action of one: help line, argument adder, runner (returns exit code)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad usage or configuration: exit code 2 with this message."""


def positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a positive `kind` (int or float)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a positive {kind.__name__}, got {text!r}"
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text}")
        return value

    return parse


def actions_parser(actions: dict[str, Subcommand]) -> Callable[[argparse.ArgumentParser], None]:
    """Adds one sub-parser per action of a subcommand (`bench`, `drill`)."""

    def add(p: argparse.ArgumentParser) -> None:
        sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
        for name, action in actions.items():
            q = sub.add_parser(name, help=action.help, description=action.help)
            action.add_arguments(q)
            q.set_defaults(_action=action.run)

    return add


def run_action(args: argparse.Namespace) -> int:
    return args._action(args)


def cuda_visible() -> bool:
    """Whether a GPU is visible, asked through NVML: initialising CUDA here would
    break the ranks the local spawner forks from this process."""
    import os

    import torch

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.is_available()
