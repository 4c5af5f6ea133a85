"""A run's life in its process, below everything else the trainer does: the OS, torchrun and Hydra
around it (process, cli), the process group, devices and seeds (runtime), the run directory's lock
(run_lock), stop signals and the ranks' agreement to stop (stop), writes that fail loudly
(storage), log files, the errors a run ends with and their exit codes (errors), components named
by config (targets), and the loop's extension points (hooks).

No imports here: train.py reads ``trainer.run.process`` before torch and Hydra load.
"""
