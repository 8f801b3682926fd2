"""`hpcft report`: a run's account from its job directory (summary.py) and its timeline as a PNG (timeline.py)."""
