"""`batchgen plan`: what a run would do, measured without running it (estimate.py), memory and time estimates
(memory.py, throughput.py) and the printed report (report.py)."""
