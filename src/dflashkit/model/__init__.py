"""The drafter networks (`drafter`: the DFlash body; `dflash2`, `dspark`, `lilicorr`: the other families' heads),
their masks, draft vocabulary, initialisation and feature scale, and the target-path labels they train on
(`path_labels`). The target itself lives in `dflashkit.target`.
"""
