"""The ``ssm-prefill`` console script.

    ssm-prefill demo [options]    the seed's incident end to end on a small hybrid model
"""
from __future__ import annotations

import argparse
import sys

from . import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssm-prefill", description="In-pass SSM state capture for chunked prefill.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo", help="run the seed's incident on a small hybrid model under every policy",
        description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(parser=demo_parser)  # its own usage line on a bad value
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # "demo", the one command (argparse refuses any other)
    demo._check(args.parser, args)
    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
