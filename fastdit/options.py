"""Method option values as text: what ``fastdit compare --set sta.tile=6,8,8`` and the app's option
boxes both read and write; and the command-line value types and one-line-error argument parser that
``fastdit``'s subcommands, the app's launcher and the ``python -m`` tools share (so that none of them
imports another's command-line module).

    parse_value("6,8,8")                 -> (6, 8, 8)
    parse_value("0.25")                  -> 0.25
    parse_value("true")                  -> True
    parse_value("[(1,3,3), (3,3,3)]")    -> [(1, 3, 3), (3, 3, 3)]
    format_value([(1, 3, 3), (3, 3, 3)]) -> "1,3,3; 3,3,3"
"""
from __future__ import annotations

import argparse
import ast

__all__ = ["ArgumentParser", "format_value", "int_type", "parse_value", "port_int", "positive_int", "seed_int"]


def parse_value(text):
    """``6,8,8`` -> (6, 8, 8); ``0.25`` -> 0.25; ``true`` -> True; ``none`` -> None; lists of
    triples as ``[(1,3,3),(3,3,3)]``; anything that is not a Python literal stays the text."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return tuple(value) if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value) else value


def format_value(value):
    """The text ``parse_value`` (or the app's tuple boxes) reads back: tuples as ``6,8,8``, lists of
    tuples as ``1,3,3; 3,3,3``, None as the empty string, anything else as ``str``."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
        return "; ".join(",".join(map(str, v)) for v in value)
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): ``PROG: error: MESSAGE (see PROG --help)``."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_type(low, high=None, what="an integer"):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expects {what}, got {value}")
        return value

    return parse


positive_int = int_type(1, what="an integer >= 1")
#: A TCP port a server can listen on (``fastdit app --port``): -1 gave a raw OverflowError at launch.
port_int = int_type(1, 65535, what="a port number from 1 to 65535")
seed_int = int_type(-(1 << 63), (1 << 64) - 1, what="an integer seed in [-2**63, 2**64 - 1]")
