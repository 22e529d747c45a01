"""`--smoke`, which every benchmark script takes: the script's whole path at tiny sizes on the CPU in seconds, so that CI
runs it (tests/unit/test_benchmark_smoke.py) and a change to the functions a benchmark calls cannot break it
unnoticed. The figures a smoke run prints mean nothing."""

from __future__ import annotations

import argparse

HELP = "tiny sizes on the CPU, seconds: checks that the script runs (CI), its figures mean nothing"


def parse_args(parser: argparse.ArgumentParser, **tiny: object) -> argparse.Namespace:
    """parser's arguments; with --smoke, tiny's values replace the defaults of those arguments (a value given on the
    command line still wins). Sets args.smoke."""
    parser.add_argument("--smoke", action="store_true", help=HELP)
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**tiny)
        args = parser.parse_args()
    return args
