"""The run report: plots (`plots.py`), the HTML page (`page.py`) and `dflashkit run`'s closing summary
(`summary.py`). `stages/report.py` and `stages/pipeline.py` are their glue."""
