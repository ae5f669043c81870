"""python -m torchcollx.fr DUMP_PREFIX: see torchcollx.fr."""
from __future__ import annotations

import sys

from . import analyze, load


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m torchcollx.fr DUMP_PREFIX   (the files DUMP_PREFIX<rank>)", file=sys.stderr)
        return 2
    dumps = load(argv[0])
    if not dumps:
        print(f"no dumps at {argv[0]}<rank>", file=sys.stderr)
        return 1
    for line in analyze(dumps):
        print(line)
    return 0


sys.exit(main())
