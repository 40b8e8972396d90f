"""Checkpoints: our record beside each orbax step and its digests (records), what a checkpoint may be resumed or
loaded into (compat), and what a resume may change in the run directory (resume)."""
