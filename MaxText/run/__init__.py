"""A training run's life: the entry's exit codes and errors (main), the run itself (loop), joining a
multi-process job (launch), stop signals and the run-directory lock (lifecycle), progress and the summary
(metrics), a full disk (disk_full), and upstream's output kept quiet unless `verbose` (quiet)."""
