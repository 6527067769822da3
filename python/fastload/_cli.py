"""Console entry point: the same command line as the Rust `fastload` binary."""

from __future__ import annotations

import os
import sys

from . import _fastload


def main() -> None:
    # `fastload bench --compare` runs the peer drivers with this interpreter (where fastload is).
    os.environ.setdefault("FASTLOAD_PYTHON", sys.executable)
    sys.exit(_fastload.cli_main(["fastload", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
