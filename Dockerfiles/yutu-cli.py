#!/opt/yutu/bin/python3
"""The image's `yutu` command (the package itself lives in /opt/yutu-app, apart from its dependencies)."""

import sys

if __name__ == "__main__":  # a multiprocessing "spawn" child imports this file again: it must not run main
    from yutu.cli import main

    sys.exit(main())
