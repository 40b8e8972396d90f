"""Walk a plan's compiled step again with whichever estimator is on PYTHONPATH (MaxText/plan/schedule.py).

  python3 tools/replan_recipes.py --hlo --plans plans ...            # keeps each plan's JSON and HLO
  PYTHONPATH=<another tree> python3 tools/rewalk.py plans/<recipe>.plan.json plans/<recipe>.hlo

Prints one JSON line: step_s, TFLOP/s/GPU, collectives_s and exposed_s by that estimator, for the same program
and the same inputs the plan's estimate had (target GPU, mesh, nodes, FLOP counts): an estimator's change apart
from any layout change (docs/planner.md "The 671B recipes"). Uses only schedule.estimate's arguments every
version since d090e34 takes.
"""

import json
import sys

from MaxText import hardware
from MaxText.plan import schedule


def main(plan_path: str, hlo_path: str) -> None:
  r = json.load(open(plan_path))
  e = r["estimate"]
  model = e["model_tflops_per_device"] * 1e12
  padded = e["grouped_shapes_flops"] > e["grouped_flops"] * 1.0001  # the plan scaled its grouped GEMMs to the count
  t = schedule.estimate(open(hlo_path).read(), hardware.GPUS[r["target_gpu"]["key"]], r["mesh"], r["nodes"],
                        fp8_experts=e["fp8_flops"] > 0, counted_flops=model + e["recompute_flops"],
                        routed_flops=e["grouped_flops"] if padded else 0.0)
  print(json.dumps({"step_s": t.step_s, "tflops_per_gpu": model / 1e12 / t.step_s, "collectives_s": t.collectives_s,
                    "exposed_s": t.exposed_s, "notes": t.notes}))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
