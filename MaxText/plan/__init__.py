"""The planner: `python -m MaxText.plan` (__main__.py) compiles a run's train step for its real GPU count without
the GPUs (aot.py in a child process, for compile-only GPU targets: gpu_target.py, or a mocked topology) and reads
memory, collectives (hlo_inventory.py) and a step estimate (MaxText/hardware.py's constants) off the compiled program
(planner.py); analytic_memory.py cross-checks the memory; search.py ranks other layouts of the same GPU count."""
