"""Console entry point: the same command line as the Rust `fastload` binary."""

from __future__ import annotations

import sys

from . import _fastload


def main() -> None:
    sys.exit(_fastload.cli_main(["fastload", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
