"""`python -m famp reshard ...`: the same as the `famp-reshard` command."""

from __future__ import annotations

import sys

from famp._fsdp.cli import main

USAGE = (
    "usage: python -m famp reshard [-h] SOURCE [SOURCE ...] ...  (see: python -m famp reshard -h)"
)

if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(USAGE)
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] != "reshard":
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
