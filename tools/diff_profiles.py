"""Per-variant op time grouped by (category, source frame, opcode, op name tail): for diffing two traced runs.

    python3 tools/bench_train.py --variants ours,dense_equivalent --profile --steps 6 --profile-steps 2 --out prof
    python3 tools/diff_profiles.py OUT.json prof/ours-*/ prof/dense_equivalent-*/

Writes {run: {group: ms per step}} and prints each run's total; the groups are subtracted by hand
(BENCHMARKS.md "End to end on one H200": where ours loses 40 ms to dense). Reads events and the HLO map with
tools/profile_breakdown.py's own functions and rules. Run on the H200 at efee304 (2026-12-01) as a scratch script
of the same code.
"""
import collections, json, sys
from pathlib import Path
sys.path.insert(0, "tools")
import profile_breakdown as pb

out = {}
for run in sys.argv[2:]:
    run = Path(run)
    events, _ = pb.read_events(pb.find_xplane(run))
    maps = pb.load_hlo_maps(run)
    step_map = maps.get("jit_train_step", {})
    by_program = {k: v for k, v in maps.items() if isinstance(k, int)}
    steps = pb.profiled_steps(run, events, "jit_train_step") or 1
    agg = collections.Counter()
    for e in events:
        if e.module is not None and e.module != "jit_train_step":
            continue
        op = by_program.get(e.program_id, step_map).get(e.hlo_op or e.name, pb._NO_OP)
        if op.opcode in pb.CONTROL_FLOW:
            continue
        desc = op.descriptor or e.scope
        cat = (pb.classify(desc, op.frames) if desc else None) or pb.classify(e.name) or ("rest" if desc else "unattributed")
        where = " < ".join(f.rsplit("/", 1)[-1] for f in op.frames[:2])
        tail = (desc or e.name).split("/")[-1][:40]
        agg[f"{cat} | {where} | {op.opcode} | {tail}"] += e.duration_ns / steps / 1e6
    out[run.name] = dict(agg.most_common())
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
print({k: round(sum(v.values()), 2) for k, v in out.items()})
