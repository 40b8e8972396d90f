"""Refuse to resume a checkpoint whose MoE routing bias has the other semantics.

Under DeepSeek-V3's router (moe_router=deepseek_v3, or upstream's model_name deepseek3*) the
gate bias is a non-trained variable (upstream's MoEBiasVar): orbax stores it under
`nnx_aux/model/.../gate/bias`, shaped [layers, experts] when scanned. Before, it was a trained
parameter: `params/params/.../gate/bias`, shaped [experts, layers], with AdamW moments. Upstream
0.2.5 resumes either checkpoint under either semantics without a word (measured: an old tiny
checkpoint resumed under the V3 router, the bias silently left at its initial value). So the run
stops first, with one line naming the bias, before anything is compiled. The same holds for
the parameters a new run starts from (`load_parameters_path`).

Likewise a resume onto another pipeline layout: upstream stores the pipelined layers as
[(repeats,) stages, (layers per stage,) ...] (patches/pipeline_v3.py) and restores a checkpoint
only into the layout that wrote it. Another stage count fails deep in orbax; another split of the
same shape (2 stages x 2 repeats against 2 stages x 2 scanned layers per stage) would restore the
layers in another order without a word. The layout is recorded at the run's start
(<run>/maxtext-moe/pipeline_layout.json) and a resume with another is refused, naming the keys.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from MaxText.checkpoints import records as checkpoint_records
from MaxText.config import UPSTREAM_V3_ROUTER_MODEL_PREFIXES, ConfigError, RunConfig


def _latest_step_metadata(checkpoints: Path) -> Path | None:
  """`items/_METADATA` of the newest checkpoint a resume restores (MaxText/checkpoints/records.py)."""
  steps = checkpoint_records.complete_steps(checkpoints.parent)
  return checkpoints / str(steps[-1]) / "items" / "_METADATA" if steps else None


def _gate_bias_paths(metadata: Path) -> list[tuple[str, ...]]:
  tree = json.loads(metadata.read_text()).get("tree_metadata", {})
  paths = [tuple(ast.literal_eval(key)) for key in tree]
  return [p for p in paths if p[-2:] == ("gate", "bias")]


def _is_trained(path: tuple[str, ...]) -> bool:
  """A bias stored with the parameters; a params-only checkpoint (upstream's save_params_to_path) keeps
  the variable beside them, in its own collection: params/MoEBiasVar/..."""
  return path[0] == "params" and path[1:2] != ("MoEBiasVar",)


def bias_is_a_variable(run: RunConfig) -> bool:
  """Whether this run's routing bias is V3's non-trained variable (else a trained parameter)."""
  model_name = str(run.upstream.get("model_name", "default"))
  return run.fork.moe_router == "deepseek_v3" or model_name.startswith(UPSTREAM_V3_ROUTER_MODEL_PREFIXES)


def check_resume(run: RunConfig) -> None:
  """ConfigError if the checkpoint this run would resume holds the routing bias the other way."""
  if not run.upstream.get("routed_bias", False) or not run.upstream.get("enable_checkpointing", True):
    return
  metadata = _latest_step_metadata(run.run_dir / "checkpoints")
  if metadata is None:
    return
  paths = _gate_bias_paths(metadata)
  trained = [p for p in paths if _is_trained(p)]
  variable = [p for p in paths if p[0] == "nnx_aux"]
  step = metadata.parent.parent
  if bias_is_a_variable(run) and trained:
    raise ConfigError(
        f"checkpoint {step} holds the MoE routing bias ({'/'.join(trained[0])}) as a trained parameter, from "
        "before moe_router=deepseek_v3 made it a non-trained variable; it cannot be resumed under DeepSeek-V3's "
        "router: start a new run (another run_name), or resume it with moe_router=upstream")
  if not bias_is_a_variable(run) and variable:
    raise ConfigError(
        f"checkpoint {step} holds the MoE routing bias ({'/'.join(variable[0])}) as DeepSeek-V3's non-trained "
        "variable; resume it with moe_router=deepseek_v3, or start a new run (another run_name)")


def _metadata_at(path: str) -> Path | None:
  """The `_METADATA` of a local checkpoint directory (`.../checkpoints/N/items`, or `.../checkpoints/N`)."""
  if "://" in path:  # object storage: orbax reads it; nothing to check before the run
    return None
  for candidate in (Path(path) / "_METADATA", Path(path) / "items" / "_METADATA"):
    if candidate.is_file():
      return candidate
  return None


def check_load_parameters(run: RunConfig) -> None:
  """ConfigError if `load_parameters_path` holds the routing bias the other way.

  Upstream restores only the `params` subtree from it: a trained bias there would be dropped under
  V3's router (its bias is a variable, left at zero), and a V3 checkpoint's bias is not in `params`.
  """
  path = str(run.upstream.get("load_parameters_path") or "")
  if not path or not run.upstream.get("routed_bias", False):
    return
  metadata = _metadata_at(path)
  if metadata is None:
    return
  paths = _gate_bias_paths(metadata)
  trained = [p for p in paths if _is_trained(p)]
  if bias_is_a_variable(run) and trained:
    raise ConfigError(
        f"config key 'load_parameters_path' = {path!r} holds the MoE routing bias ({'/'.join(trained[0])}) as a "
        "trained parameter, from before moe_router=deepseek_v3 made it a non-trained variable: DeepSeek-V3's "
        "router would start from a zero bias; load it with moe_router=upstream")
  if not bias_is_a_variable(run) and paths and not trained:
    raise ConfigError(
        f"config key 'load_parameters_path' = {path!r} holds the MoE routing bias as DeepSeek-V3's non-trained "
        f"variable ({'/'.join(paths[0])}), outside the parameters this run loads: load it with "
        "moe_router=deepseek_v3")


PIPELINE_LAYOUT = "pipeline_layout.json"  # in <run>/maxtext-moe/


def pipeline_layout(config) -> dict:
  """What fixes the pipelined layers' checkpoint layout, from upstream's resolved config."""
  stages = int(config.ici_pipeline_parallelism) * int(config.dcn_pipeline_parallelism)
  if stages == 1:
    return {"stages": 1}
  return {"stages": stages, "num_pipeline_repeats": int(config.num_pipeline_repeats),
          "num_layers_per_pipeline_stage": int(config.num_layers_per_pipeline_stage),
          "scan_layers_per_stage": bool(config.scan_layers_per_stage),
          "pipeline_parallel_layers": int(config.pipeline_parallel_layers)}


def check_pipeline_resume(run: RunConfig, config) -> None:
  """ConfigError if the checkpoint this run would resume was written with another pipeline layout."""
  record = run.run_dir / "maxtext-moe" / PIPELINE_LAYOUT
  if not run.upstream.get("enable_checkpointing", True) or not record.is_file():
    return  # no record: a run from before the record (a shape change is still named by patches/checkpoint_restore.py)
  metadata = _latest_step_metadata(run.run_dir / "checkpoints")
  if metadata is None:
    return
  before, now = json.loads(record.read_text()), pipeline_layout(config)
  order = ["stages", "num_pipeline_repeats", "num_layers_per_pipeline_stage", "scan_layers_per_stage",
           "pipeline_parallel_layers"]
  changed = [k for k in order + sorted(set(before) | set(now) - set(order)) if before.get(k) != now.get(k)]
  if changed:
    name = {"stages": "stages (ici_pipeline_parallelism x dcn_pipeline_parallelism)"}
    what = ", ".join(f"{name.get(k, k)} {before.get(k, '(no pipeline)')} -> {now.get(k, '(no pipeline)')}"
                     for k in changed)
    raise ConfigError(f"checkpoint {metadata.parent.parent} was written with another pipeline layout ({what}): "
                      "upstream restores a checkpoint only into the layout that wrote it; resume with the "
                      "checkpoint's, or start a new run (another run_name)")


def record_pipeline_layout(run: RunConfig, config) -> None:
  """Writes this run's layout (after check_pipeline_resume passed: unchanged, or nothing to resume)."""
  out = run.run_dir / "maxtext-moe"
  out.mkdir(parents=True, exist_ok=True)
  (out / PIPELINE_LAYOUT).write_text(json.dumps(pipeline_layout(config), indent=2, sort_keys=True))
