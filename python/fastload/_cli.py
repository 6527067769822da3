"""Console entry point: the same command line as the Rust `fastload` binary."""

from __future__ import annotations

import os
import signal
import sys
import urllib.parse

from . import _fastload


def _arg(arg: str) -> str:
    """An argument that is not UTF-8 (os.fsdecode's surrogates) can only be a local path: it
    goes to the native CLI as a file:// URI, percent-encoded byte for byte (as the binary does)."""
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:
        return "file://" + urllib.parse.quote_from_bytes(os.fsencode(os.path.abspath(arg)))
    return arg


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        # A serve stops cleanly on SIGINT itself: Python's handler would raise KeyboardInterrupt
        # once it has.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    # In-process: `fastload bench` runs its peers with this interpreter (sys.executable) unless
    # --python or $FASTLOAD_PYTHON names another.
    sys.exit(_fastload.cli_main(["fastload", *map(_arg, sys.argv[1:])]))


if __name__ == "__main__":
    main()
