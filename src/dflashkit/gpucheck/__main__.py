"""`python -m dflashkit.gpucheck SPEC.json`: run one GPU check in this process (the runner's child).

SPEC.json (written by `runner.run_isolated`): name, target (`module:function`), device, work_dir, budget_s,
result (where the check's result JSON goes; written also when the check raises).
"""

import sys

from dflashkit.gpucheck.runner import child_main

if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
