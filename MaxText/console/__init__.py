"""What a long command says while it works: progress lines, heartbeats, the phase of a compile, ETAs and sizes
(progress), and how our commands end (ending). Imports nothing else of ours, so the run, the planner and the patches all may use it."""
