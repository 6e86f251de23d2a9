"""`python -m dflashkit ...` is the same as the `dflashkit` console script.

A torchrun rank (it joined a process group) ends through `train.parallel.exit_rank`: flushed, then
`os._exit`, without interpreter finalization while torch's native threads live (docs/architecture.md)."""

import sys

from dflashkit.cli import main


def run_as_main() -> None:
    rc = main()
    parallel = sys.modules.get("dflashkit.train.parallel")  # loaded only when a command used torch.distributed
    if parallel is not None:
        parallel.exit_rank(rc)
    raise SystemExit(rc)


if __name__ == "__main__":
    run_as_main()
