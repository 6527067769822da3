"""``python -m fastload ...``: the same command line as the ``fastload`` script (see _cli)."""

from ._cli import main

if __name__ == "__main__":
    main()
