"""``python -m omni_serve.checkpoints NAME [--cache-dir DIR]``: build a tiny checkpoint if needed, print its path."""

from __future__ import annotations

import argparse
import logging

from omni_serve.checkpoints import CHECKPOINTS, DEFAULT_TINY, TINY, ensure


def main(argv: list[str] | None = None) -> None:
    names = "\n".join(f"  {c.name:<16} {c.about}" for c in CHECKPOINTS.values())
    parser = argparse.ArgumentParser(
        prog="python -m omni_serve.checkpoints",
        description="Build (or find) a tiny random-weight checkpoint in the cache and print its path.",
        epilog=f"checkpoints ({TINY} = {DEFAULT_TINY}):\n{names}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=[TINY, *CHECKPOINTS], metavar="NAME", help="the checkpoint (see below)")
    parser.add_argument(
        "--cache-dir", default=None, help="cache root (default: $OMNI_SERVE_CACHE, else ~/.cache/omni_serve)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # says when it builds
    print(ensure(args.name, args.cache_dir))


if __name__ == "__main__":
    main()
