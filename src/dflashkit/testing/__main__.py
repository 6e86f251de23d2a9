"""`python -m dflashkit.testing DIR [ARCH [WRAPPER]]`: write a tiny target to DIR and print DIR."""

import sys

from dflashkit.model.tiny import make_tiny_target

if __name__ == "__main__":
    make_tiny_target(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "qwen3",
                     wrapper=sys.argv[3] if len(sys.argv) > 3 else None)
    print(sys.argv[1])
