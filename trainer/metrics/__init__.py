"""What a run reports: the metrics logger (metrics.jsonl and W&B, through its sidecar), step
times, throughput and MFU (perf), the console's progress bar, results files and tables, and the
report at the end of a sweep.
"""
