"""Gradient accumulation schedules over microbatches (MaxText/accumulate/combined_1f1b.py)."""
