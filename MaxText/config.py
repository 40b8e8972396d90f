"""Our config: load a YAML chain plus `key=value` overrides, split our keys from
upstream MaxText's, and validate both before anything is compiled or written.

A config file may name `base_config:` (one path or a list, merged in order).
Paths resolve relative to the file, then to our `configs/`, then to upstream's
`maxtext/configs/`. Upstream's `base.yml` is always the implicit root, so our
files hold only what differs from it.

Errors are `ConfigError`s whose message is one line naming the key or path.
"""

from __future__ import annotations

import datetime
import difflib
import json
import os
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import omegaconf
import pydantic

from MaxText import overflow

# The shipped configs: MaxText/configs links to the repo's configs/ in a checkout
# and is a copy inside an installed wheel (pyproject package-data).
REPO_CONFIGS = Path(__file__).parent / "configs"
DEFAULT_CONFIG = REPO_CONFIGS / "deepseek3-tiny.yml"
BASE_CONFIG_KEY = "base_config"


class ConfigError(ValueError):
  """A config problem, described in one line that names the key or path."""


class ForkConfig(pydantic.BaseModel):
  """Keys that belong to maxtext-moe, not upstream. Upstream never sees them.

  Each subsystem owns a section; every key has a one-line `description` (what
  `python -m MaxText.train --help` prints; tests/test_configs.py checks it is there).
  """

  model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

  # --- run (MaxText/train.py) ---
  progress_every: int = pydantic.Field(
      default=1, ge=0, description='Print our "[progress]" line every N train steps (0 turns it off).')
  mfu_peak_tflops: float | None = pydantic.Field(
      default=None, gt=0,
      description="Dense bf16 peak TF/s per device that MFU is measured against (progress line, perf/mfu); unset: "
      "the GPU's datasheet figure (MaxText/plan/hardware.py PEAK_BF16_FLOPS), n/a on unknown devices and CPU.")
  allow_schedule_change: bool = pydantic.Field(
      default=False,
      description="Resume even when the learning-rate schedule differs from the checkpoint's (else refused; "
      "MaxText/lifecycle.py).")
  verbose: bool = pydantic.Field(
      default=False,
      description="Print what upstream prints as it runs: its INFO log lines (its own per-step line, the "
      "checkpoint manager's), its prints (the step's TFLOPs, the \"[DECOUPLED NO-OP]\" stub notices) and "
      "transformers' warnings, and our start-up details (patches, XLA_FLAGS); else absl logs at WARNING "
      "(MaxText/quiet.py). XLA's own C++ INFO lines: TF_CPP_MIN_LOG_LEVEL=0.")
  nonfinite_skip_batches: int = pydantic.Field(
      default=0, ge=0,
      description="After a stop at a non-finite step N (exit 4), the resume from the last finite checkpoint C "
      "skips this many batches after C, and never fewer than the N-C through the one that went non-finite "
      "(0: replay them; MaxText/lifecycle.py).")
  allow_data_change: bool = pydantic.Field(
      default=False,
      description="Resume even when the data (dataset_type, its files, the tokenizer, vocab_size) differs from "
      "what the run recorded (else refused; MaxText/lifecycle.py).")

  # --- MoE (MaxText/moe) ---
  moe_gmm_backend: Literal["upstream", "auto", "xla", "tokamax", "mgpu", "te"] = pydantic.Field(
      default=None,
      description="Grouped-GEMM backend (MaxText/moe/gmm) of our block, or of upstream's sparse_matmul under "
      "moe_block=upstream (\"upstream\" leaves that path untouched; the others set megablox=true, see "
      "MOE_GMM_UPSTREAM_KEYS). Unset: auto with moe_block=ours (mgpu on Hopper), else upstream.")

  @pydantic.model_validator(mode="before")
  @classmethod
  def _gmm_backend_follows_the_block(cls, data: Any) -> Any:
    if isinstance(data, dict) and data.get("moe_gmm_backend") is None:
      data = {**data, "moe_gmm_backend": "auto" if data.get("moe_block") == "ours" else "upstream"}
    return data

  moe_fp8: Literal["none", "blockwise"] = pydantic.Field(
      default="none",
      description="Our block's expert GEMMs in FP8. blockwise: DeepSeek-V3's recipe (e4m3; 1x128 activation "
      "tiles, 128x128 weight blocks; f32 promotion every 128 of the contraction) on Hopper (grouped-GEMM backend "
      "mgpu_fp8; xla_fp8 emulates it on CPU). The forward, dlhs and dW GEMMs all run in FP8 (dW's operands in "
      "128x1 tiles along the rows, each expert's rows 128-aligned). Needs moe_block=ours and moe_gmm_backend unset "
      "(auto).")

  # --- MoE block (MaxText/moe/block.py, patches/routed_moe.py) ---
  moe_block: Literal["upstream", "ours", "te"] = pydantic.Field(
      default="upstream",
      description="Routed-MoE block: upstream's, ours (route -> dispatch -> gmm -> combine), or upstream's TE "
      "MoEBlock path.")
  moe_dispatch_backend: Literal["auto", "local", "ring", "ragged_a2a", "a2a_padded", "hierarchical",
                                "te_ncclep"] = pydantic.Field(
      default="auto",
      description="Our block's dispatch (MaxText/moe/dispatch); auto: local, or with EP ring (CPU) / a2a_padded (GPU); "
      "hierarchical: EP across nodes in two exchanges, a token crossing InfiniBand once per node it needs.")
  moe_hierarchical_capacity_factor: float = pydantic.Field(
      default=2.0, gt=0, allow_inf_nan=False,  # inf: ceil(inf x rows) is an OverflowError at the first trace
      description="hierarchical: each stage's buffer = factor x its balanced share ((token, node) rows per node, "
      "capped at the tokens; slots per GPU inside the node); the EP size never overflows.")
  moe_ep_overlap_chunks: int = pydantic.Field(
      # Each chunk is its own copy of the dispatch, grouped GEMMs and combine in every MoE layer of the compiled
      # program, so the compile grows with it (256 on the tiny config compiled for more than 5 minutes); 2 is what
      # the compile-only H200 schedule was read at (BENCHMARKS.md, "Dispatch and expert parallelism").
      default=1, ge=1, le=8,
      description="Our block under EP splits each shard's tokens into this many chunks (at most 8), each dispatched, "
      "computed and combined on its own, so that one chunk's all-to-all overlaps another's grouped GEMMs; 1: no "
      "split. No effect without EP; must divide the tokens per shard.")
  moe_node_limited_routing: bool = pydantic.Field(
      default=False,
      description="DeepSeek-V3's node-limited routing: moe_router=deepseek_v3's groups are the EP nodes "
      "(n_routing_groups = dcn_expert_parallelism; unset: set to it), each scored by the sum of its top K/M biased "
      "scores (M = topk_routing_group, which must divide num_experts_per_tok), so each token's experts are on at "
      "most M nodes.")
  moe_a2a_padded_capacity_factor: float = pydantic.Field(
      default=2.0, gt=0, allow_inf_nan=False,
      description="a2a_padded: rows per peer buffer = factor x the balanced share (the EP size never overflows).")
  moe_a2a_padded_on_overflow: Literal["error", "flag"] = pydantic.Field(
      default="error",
      description="a bounded dispatch buffer (a2a_padded, ragged_a2a, hierarchical) sent more rows than it holds: "
      "error stops the run after that step (exit 8, the step not saved); flag, only with upstream's "
      "moe_dropless_fallback=step, replays the step with every buffer at the EP size (MaxText/overflow.py).")
  moe_ragged_a2a_capacity_factor: float | None = pydantic.Field(
      default=None, gt=0, allow_inf_nan=False,
      description="ragged_a2a: receive rows = factor x this shard's T*K (unset: the EP size, never overflows).")
  moe_log_expert_load: bool = pydantic.Field(
      default=False,
      description="Our block reports each MoE layer's tokens per expert to the host (max/mean in the run summary); "
      "a jax.debug.callback per layer call: for measurements, not for production runs.")
  moe_metrics_every_n_steps: int = pydantic.Field(
      default=1, ge=0,
      description="Our block's routing statistics (tokens per expert, load ratio, CV, idle experts, router "
      "entropy, bias, overflow) as moe/ TensorBoard scalars, a histogram and a heatmap every N steps; 0 turns "
      "them off and compiles nothing extra. Computed in the step, no host callback: 0.1% of the step on one H200 "
      "(BENCHMARKS.md, \"End to end on one H200\").")
  moe_metrics_heatmap_every_n_steps: int = pydantic.Field(
      default=100, ge=0,
      description="A layers x experts heatmap of load / mean in TensorBoard's images tab every N steps, its numbers "
      "on stdout up to 32 experts and 16 MoE layers (0: none); "
      "needs moe_metrics_every_n_steps > 0.")
  moe_profile_every_n_steps: int = pydantic.Field(
      default=0, ge=0,
      description="The MoE time split live: every N steps (steps s with (s+1) % N == 0, never a process's first "
      "step, which compiles) a jax.profiler trace of that one step into <run>/moe_profile/step_<s>/, classified "
      "into route/dispatch/gmm/combine/attention/rest (xprof's per-op statistics) as moe_time/ TensorBoard "
      "scalars and a log line. 0: off. Process 0 only; needs profiler unset (one trace at a time).")
  moe_te_ncclep_recv_capacity_per_rank: int | None = pydantic.Field(
      default=None, ge=1,
      description="te_ncclep: rows each rank receives (TE's recv_capacity_per_rank); unset: the dropless bound "
      "for the batch.")
  moe_te_ncclep_alignment: int = pydantic.Field(
      default=128, ge=1,
      description="te_ncclep: rows each local expert's zone is padded to, a power of two (TE's moe.py uses 128 "
      "for NCCL EP).")

  @pydantic.field_validator("moe_te_ncclep_alignment")
  @classmethod
  def _alignment_is_a_power_of_two(cls, value: int) -> int:
    if value & (value - 1):
      raise ValueError("must be a power of two (1, 2, 4, ..., 128)")
    return value

  # --- Router and training schedule of DeepSeek-V3 (patches/deepseek_v3_router.py, patches/train_schedule.py) ---
  moe_router: Literal["upstream", "deepseek_v3"] = pydantic.Field(
      default="upstream",
      description="deepseek_v3: DeepSeek-V3's router (selection-only bias variable, group-limited routing, bias "
      "update) on either block, whatever model_name says; upstream 0.2.5 applies it only to model names deepseek3*.")
  moe_bias_update_stop_tokens: int | None = pydantic.Field(
      default=None, ge=1,
      description="Training tokens after which the routing-bias update rate becomes 0 (V3: 14.3T); unset: never.")
  mtp_loss_switch_tokens: int | None = pydantic.Field(
      default=None, ge=1,
      description="Training tokens after which the MTP loss weight becomes mtp_loss_scaling_factor_late "
      "(V3: 10T, 0.3 -> 0.1).")
  mtp_loss_scaling_factor_late: float | None = pydantic.Field(
      default=None, ge=0, description="The MTP loss weight after mtp_loss_switch_tokens (V3: 0.1).")

  # --- XLA / environment presets (MaxText/xla_presets.py) ---
  xla_presets: list[str] = pydantic.Field(
      default_factory=list,
      description="Named XLA flag/env presets (python -m MaxText.xla_presets lists them), merged in order; "
      "your XLA_FLAGS win.")
  recipe_num_gpus: int | None = pydantic.Field(
      default=None, ge=1,
      description="GPUs a recipe (configs/recipes/) is written for; the run refuses any other count.")

  # --- planner (MaxText/plan/planner.py) ---
  target_gpu: Literal["h100", "h200", "b200"] | None = pydantic.Field(
      default=None,
      description="GPU the run is planned for: its HBM, GEMM rate and links (MaxText/plan/hardware.py); unset: the "
      "local GPU's kind.")
  gpus_per_node: int = pydantic.Field(
      default=8, ge=1,
      description="GPUs per node (one NVLink domain): collectives over more cross InfiniBand; the mocked "
      "topology's slice size.")


@dataclass(frozen=True)
class RunConfig:
  """A validated run: our keys, upstream's keys, and where outputs go.

  Attributes:
    config_path: the YAML the run was started from.
    fork: our keys.
    upstream: upstream keys that differ from upstream's base.yml (file chain
      merged with CLI overrides, plus our local-first defaults).
    explicit: keys the user set (in a file or on the command line).
    origins: where each explicit key was set: a file of the chain, or "command line".
  """

  config_path: Path
  fork: ForkConfig
  upstream: dict[str, Any]
  explicit: frozenset[str]
  origins: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

  @property
  def run_dir(self) -> Path:
    return Path(self.upstream["base_output_directory"]) / self.upstream["run_name"]

  def upstream_argv(self) -> list[str]:
    """argv for upstream's `train.main`: its base.yml, then every key as key=value.

    Keys go on the command line (not into a YAML) so that upstream treats them
    as overrides: its model config (`model_name`) must not override them back.
    JSON is valid YAML flow syntax, so values survive OmegaConf's CLI parser.
    """
    return ["maxtext-moe", str(upstream_configs_dir() / "base.yml")] + [
        f"{k}={json.dumps(v)}" for k, v in self.upstream.items()
    ]


def upstream_configs_dir() -> Path:
  import maxtext  # pylint: disable=import-outside-toplevel

  return Path(maxtext.__file__).resolve().parent / "configs"


def upstream_fields() -> dict[str, Any]:
  """Upstream's pydantic fields, including those of nested models."""
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  fields = dict(types.MaxTextConfig.model_fields)
  for info in list(fields.values()):
    nested = getattr(info.annotation, "model_fields", None)
    if nested:
      fields.update(nested)
  return fields


def _resolve_base(name: str, relative_to: Path) -> Path | None:
  """base_config lookup: next to the file, our configs/, upstream's configs/."""
  candidates = [Path(name)] if os.path.isabs(name) else [relative_to.parent / name, REPO_CONFIGS / name]
  if not os.path.isabs(name):
    candidates.append(upstream_configs_dir() / name)
  return next((c.resolve() for c in candidates if c.is_file()), None)


def load_yaml_chain(path: Path, _seen: tuple[Path, ...] = (), origins: dict[str, str] | None = None) -> dict[str, Any]:
  """Loads `path` and its base_config chain, merged (later wins).

  `origins`, when given, receives each key's file (the last in the chain to set it).
  """
  path = path.resolve()
  if path in _seen:
    raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
  try:
    cfg = omegaconf.OmegaConf.load(path)
  except FileNotFoundError as e:
    raise ConfigError(f"config file not found: {path}") from e
  except Exception as e:  # yaml.YAMLError and friends: report the file and the parser's word
    raise ConfigError(f"cannot parse {path}: {str(e).splitlines()[0]}") from e
  if not isinstance(cfg, omegaconf.DictConfig):
    raise ConfigError(f"{path} must hold a mapping of key: value, not a {type(cfg).__name__}")
  merged = omegaconf.OmegaConf.create({})
  bases = cfg.pop(BASE_CONFIG_KEY, None)
  bases = [bases] if isinstance(bases, str) else bases
  if bases is not None and not (isinstance(bases, (list, omegaconf.ListConfig)) and all(isinstance(b, str) for b in bases)):
    raise ConfigError(f"{path}: base_config must be a path or a list of paths, not {_yaml_value(bases)}")
  for base in bases or []:
    base_path = _resolve_base(str(base), path)
    if base_path is None:
      raise ConfigError(f"{path}: base_config '{base}' not found next to it, in {REPO_CONFIGS} or upstream's configs")
    if base_path == (upstream_configs_dir() / "base.yml").resolve():
      continue  # upstream's base.yml is always the root; upstream loads it itself
    merged = omegaconf.OmegaConf.merge(merged, load_yaml_chain(base_path, (*_seen, path), origins))
  if origins is not None:
    origins.update((str(k), str(path)) for k in cfg.keys())
  return _resolved(omegaconf.OmegaConf.merge(merged, cfg), str(path))


def _yaml_value(value: Any) -> str:
  if isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
    value = omegaconf.OmegaConf.to_container(value)
  return repr(value)


def _resolved(cfg: omegaconf.DictConfig, origin: str) -> dict[str, Any]:
  """Plain values, with ${...} interpolations resolved; one that does not resolve names its key."""
  try:
    return omegaconf.OmegaConf.to_container(cfg, resolve=True)
  except omegaconf.errors.OmegaConfBaseException as e:
    key = getattr(e, "full_key", None) or "?"
    raw = omegaconf.OmegaConf.to_container(cfg, resolve=False)
    value = raw.get(key, "?") if isinstance(raw, dict) else "?"
    reason = " ".join(str(e).splitlines()[0].split())
    raise ConfigError(f"config key '{key}' = {value!r} ({origin}): {reason}") from None


def parse_overrides(args: list[str]) -> dict[str, Any]:
  for arg in args:
    if "=" not in arg or arg.startswith("="):
      raise ConfigError(f"override '{arg}' is not of the form key=value")
  try:
    cli = omegaconf.OmegaConf.from_cli(list(args))
  except omegaconf.errors.OmegaConfBaseException as e:
    raise ConfigError(f"overrides {' '.join(args)}: {' '.join(str(e).splitlines()[0].split())}") from None
  return _resolved(cli, "command line")


def _unknown_key_error(key: str, origin: str, known: list[str]) -> ConfigError:
  close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
  hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
  return ConfigError(f"unknown config key '{key}' ({origin}){hint}")


def _check_upstream_type(key: str, value: Any, info: Any, origin: str) -> None:
  """Checks one upstream value against upstream's pydantic annotation."""
  if isinstance(value, str) and value.lower() == "none":
    return  # upstream maps "none" to None itself
  try:
    adapter = pydantic.TypeAdapter(info.annotation)
  except Exception:  # pylint: disable=broad-exception-caught
    return  # annotations pydantic cannot adapt standalone are left to upstream
  try:
    adapter.validate_python(value)
  except pydantic.ValidationError as e:
    reason = e.errors()[0]["msg"]
    raise ConfigError(f"config key '{key}' = {value!r} ({origin}): {reason}") from None


def _fork_error(e: pydantic.ValidationError, origins: dict[str, str]) -> ConfigError:
  err = e.errors()[0]
  if not err["loc"]:  # a model validator: its message names the keys
    return ConfigError(str(err["msg"]).removeprefix("Value error, "))
  key = str(err["loc"][0]) if err["loc"] else "?"
  return ConfigError(f"config key '{key}' = {err.get('input')!r} ({origins.get(key, 'default')}): {err['msg']}")


# Upstream keys under which upstream's sparse_matmul sends its grouped GEMMs to
# `maxtext.kernels.megablox.gmm`, the seam patches/megablox_gmm.py replaces
# (layers/moe.py ~2296-2319 in maxtext 0.2.5); upstream's defaults all qualify.
MOE_GMM_UPSTREAM_KEYS: dict[str, Any] = {
    "sparse_matmul": True,  # else the dense capacity path runs: no grouped GEMM
    "megablox": True,  # else jax.lax.ragged_dot is called directly, not the seam
    "use_tokamax_gmm": False,  # else tokamax.ragged_dot is called directly
    "te_moe_block": False,  # else TE's whole MoE block runs instead of sparse_matmul
    "quantization": "",  # our backends do not quantize
}


def check_moe_keys(fork: ForkConfig, origins: dict[str, str]) -> None:
  """Our MoE keys that contradict each other: a ConfigError naming both."""
  def where(key: str) -> str:
    return origins.get(key, "default")

  def clash(a: str, b: str, why: str) -> ConfigError:
    return ConfigError(f"config keys '{a}' = {getattr(fork, a)!r} ({where(a)}) and '{b}' = {getattr(fork, b)!r} "
                       f"({where(b)}) contradict each other: {why}")

  if fork.moe_block == "ours" and fork.moe_gmm_backend == "upstream":
    raise clash("moe_block", "moe_gmm_backend", "our block runs our grouped GEMM; leave moe_gmm_backend unset "
                "(auto) or pick one of auto, xla, tokamax, mgpu, te")
  if fork.moe_block == "te" and fork.moe_gmm_backend != "upstream":
    raise clash("moe_block", "moe_gmm_backend", "TE's MoE block runs TE's own grouped GEMM")
  if fork.moe_fp8 != "none" and fork.moe_block != "ours":
    raise clash("moe_fp8", "moe_block", "FP8 experts are our block's (moe_block=ours)")
  if fork.moe_fp8 != "none" and fork.moe_gmm_backend != "auto":
    raise clash("moe_fp8", "moe_gmm_backend", "moe_fp8 picks its own grouped GEMM (mgpu_fp8 on Hopper, xla_fp8 on "
                "CPU); leave moe_gmm_backend unset")
  if fork.moe_block != "ours" and "moe_dispatch_backend" in origins:
    raise clash("moe_block", "moe_dispatch_backend", "only our block (moe_block=ours) dispatches with it")


def moe_gmm_upstream_keys(fork: ForkConfig, upstream: dict[str, Any], origins: dict[str, str]) -> dict[str, Any]:
  """Upstream keys with what moe_gmm_backend needs under moe_block=upstream; ConfigError on a conflict.

  megablox=false set in a config file (as the CPU configs do, to keep upstream's
  Pallas kernel out of interpret mode) becomes true: our patch replaces that
  call, so no Pallas kernel runs. Any conflicting value given on the command
  line, or any other conflicting key, is an error naming the key. Our block
  never reaches upstream's sparse_matmul, so these keys do not matter to it.
  """
  if fork.moe_gmm_backend == "upstream" or fork.moe_block != "upstream":
    return upstream
  out = dict(upstream)
  for key, need in MOE_GMM_UPSTREAM_KEYS.items():
    have = upstream.get(key, need)
    if have == need or (need == "" and not have):  # quantization: "" and None both mean off
      continue
    if key == "megablox" and origins.get(key) != "command line":
      out[key] = True
      continue
    raise ConfigError(
        f"config key '{key}' = {have!r} ({origins.get(key, 'default')}) conflicts with "
        f"moe_gmm_backend={fork.moe_gmm_backend}: it needs {key}={json.dumps(need)} "
        "(or moe_gmm_backend=upstream)"
    )
  return out


# Upstream 0.2.5 gives a model DeepSeek-V3's router only when model_name starts with one of these
# (layers/moe.py ~640 GateLogit's bias variable, ~1321 get_topk); patches/deepseek_v3_router.py
# gives it to moe_router=deepseek_v3 runs whatever the name.
UPSTREAM_V3_ROUTER_MODEL_PREFIXES = ("deepseek3", "deepseek4", "kimi-k2")


def _router_checks(fork: ForkConfig, upstream: dict[str, Any], origins: dict[str, str]) -> None:
  """ConfigError for a router key that cannot take effect (never silently ignored)."""
  fields = upstream_fields()
  get = lambda key: upstream.get(key, fields[key].default)  # noqa: E731

  def error(key: str, why: str) -> ConfigError:
    value = getattr(fork, key) if key in ForkConfig.model_fields else get(key)
    return ConfigError(f"config key '{key}' = {value!r} ({origins.get(key, 'default')}): {why}")

  if fork.moe_node_limited_routing:
    _node_limit_checks(fork, get, error, origins)
  upstream_v3 = str(get("model_name")).startswith(UPSTREAM_V3_ROUTER_MODEL_PREFIXES)
  if fork.moe_router == "upstream" and not upstream_v3:
    for key, off in (("n_routing_groups", -1), ("topk_routing_group", -1), ("routed_bias_update_rate", 0.0)):
      if get(key) != off:  # ignored (groups) or a compile-time crash (rate) at upstream's other model names
        raise error(key, "upstream applies it only to model_name deepseek3*; set moe_router=deepseek_v3")
  if fork.moe_router == "deepseek_v3":
    if get("model_name") != "default" and not str(get("model_name")).startswith("deepseek3"):
      raise error("model_name", "moe_router=deepseek_v3 needs model_name default or deepseek3*")
    for key, need in (("decoder_block", "deepseek"), ("routed_score_func", "sigmoid"), ("routed_bias", True)):
      if get(key) != need:
        raise error(key, f"moe_router=deepseek_v3 needs {key}={json.dumps(need)}")
    groups, top_groups, experts = get("n_routing_groups"), get("topk_routing_group"), get("num_experts")
    if (groups > 0) != (top_groups > 0):
      raise error("topk_routing_group", "set both n_routing_groups and topk_routing_group, or neither")
    if groups > 0 and (experts % groups or experts // groups < 2):
      raise error("n_routing_groups", f"must split num_experts={experts} into groups of 2 or more experts")
    fits = get("num_experts_per_tok") <= top_groups * (experts // groups) and top_groups <= groups
    # More experts per token than exist: config_checks names num_experts_per_tok itself.
    if groups > 0 and get("num_experts_per_tok") <= experts and not fits:
      raise error("topk_routing_group", f"its groups must hold num_experts_per_tok={get('num_experts_per_tok')} "
                  f"experts, at most n_routing_groups={groups}")
  bias_moves = fork.moe_router == "deepseek_v3" or upstream_v3
  if fork.moe_bias_update_stop_tokens is not None and not (bias_moves and get("routed_bias_update_rate") > 0):
    raise error("moe_bias_update_stop_tokens", "needs routed_bias_update_rate > 0 and moe_router=deepseek_v3")
  if (fork.mtp_loss_switch_tokens is None) != (fork.mtp_loss_scaling_factor_late is None):
    raise error("mtp_loss_switch_tokens", "set it together with mtp_loss_scaling_factor_late, or neither")
  if fork.mtp_loss_switch_tokens is not None and get("mtp_num_layers") < 1:
    raise error("mtp_loss_switch_tokens", "needs mtp_num_layers >= 1")


def node_limited_groups(fork: ForkConfig, upstream: dict[str, Any]) -> dict[str, Any]:
  """moe_node_limited_routing with n_routing_groups unset: one routing group per EP node (dcn_expert_parallelism)."""
  if not fork.moe_node_limited_routing or fork.moe_router != "deepseek_v3" or int(upstream.get("n_routing_groups", -1)) > 0:
    return upstream
  return {**upstream, "n_routing_groups": int(upstream.get("dcn_expert_parallelism", 1))}


def _node_limit_checks(fork: ForkConfig, get, error, origins: dict[str, str]) -> None:
  """DeepSeek-V3's node-limited routing (arXiv 2412.19437, §2.1.2): each token's experts on at most M nodes, the
  nodes chosen by the sum of the highest K/M biased scores of the experts on each. Our router does it with one
  routing group per EP node (experts are laid out node-major over the expert axis, dcn_expert_parallelism x
  ici_expert_parallelism, so group g is node g's experts), M = topk_routing_group groups kept, each scored by its
  top K/M (MaxText/moe/routing.py node_limited). More groups than nodes would limit groups, not nodes."""
  if fork.moe_router != "deepseek_v3":
    raise error("moe_node_limited_routing", "needs moe_router=deepseek_v3 (its group-limited routing limits the nodes)")
  nodes, groups = get("dcn_expert_parallelism"), get("n_routing_groups")
  if nodes < 1:
    raise error("dcn_expert_parallelism", "moe_node_limited_routing needs the EP nodes written out (>= 1)")
  if groups != nodes:
    raise ConfigError(f"config keys 'n_routing_groups' = {groups} ({origins.get('n_routing_groups', 'default')}) and "
                      f"'dcn_expert_parallelism' = {nodes} ({origins.get('dcn_expert_parallelism', 'default')}) "
                      "contradict moe_node_limited_routing=true: the routing groups are the EP nodes, so "
                      "n_routing_groups must equal dcn_expert_parallelism (or be unset: set to it)")
  top_k, limit = get("num_experts_per_tok"), get("topk_routing_group")
  if limit < 1:
    raise error("topk_routing_group", "moe_node_limited_routing needs it: the nodes a token's experts may sit on (V3: 4)")
  if top_k % limit:
    raise ConfigError(f"config keys 'num_experts_per_tok' = {top_k} ({origins.get('num_experts_per_tok', 'default')}) "
                      f"and 'topk_routing_group' = {limit} ({origins.get('topk_routing_group', 'default')}) contradict "
                      "moe_node_limited_routing=true: a node is scored by its top K/M experts, so M must divide K")
  if fork.moe_block != "ours" and top_k != 2 * limit:
    raise ConfigError(f"config keys 'moe_block' = {fork.moe_block!r} ({origins.get('moe_block', 'default')}) and "
                      f"'moe_node_limited_routing' = True ({origins.get('moe_node_limited_routing', 'default')}): "
                      f"upstream's router scores a group by its top 2, node-limited routing by its top K/M = "
                      f"{top_k}/{limit}; set moe_block=ours (or num_experts_per_tok = 2 x topk_routing_group)")


def local_first_defaults(upstream: dict[str, Any], config_path: Path) -> dict[str, Any]:
  """Fills output locations so that a run writes only under its run directory."""
  out = dict(upstream)
  out.setdefault("base_output_directory", str(Path.cwd() / "outputs"))
  out["base_output_directory"] = str(Path(os.path.expanduser(out["base_output_directory"])).absolute())
  if not out.get("run_name"):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out["run_name"] = f"{config_path.stem}-{stamp}"
  run_dir = Path(out["base_output_directory"]) / out["run_name"]
  # Upstream defaults: "~/jax_cache" (base.yml) and "/tmp/xla_dump/".
  out.setdefault("jax_cache_dir", str(run_dir / "jax_cache"))
  out.setdefault("dump_hlo_local_dir", str(run_dir / "xla_dump") + "/")
  return out


def recipe_num_slices(fork: ForkConfig, upstream: Mapping[str, Any]) -> int | None:
  """A GPU recipe's slices: one per node (jax's slice is a node's NVLink domain); None for one node.

  Upstream counts slices from the devices as it validates, so without them (a laptop) it refuses a DCN
  axis; named as the planner names it (MaxText/plan/planner.py), the recipe validates anywhere as it runs."""
  if not fork.recipe_num_gpus or not str(upstream.get("hardware", "tpu")).startswith("gpu"):
    return None
  nodes = fork.recipe_num_gpus // fork.gpus_per_node
  return nodes if nodes > 1 else None


def resolve_config_path(name: str) -> Path:
  """The config named on the command line: as given (from the working directory),
  else the shipped one (a leading `configs/` dropped), so that
  `configs/recipes/x.yml` works from any directory: in a container, or with only
  the installed package (Kubernetes, the wheelhouse)."""
  path = Path(name)
  if path.is_file() or path.is_absolute():
    return path
  parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
  shipped = REPO_CONFIGS.joinpath(*parts) if parts else path
  return shipped if shipped.is_file() else path


def load(args: list[str]) -> RunConfig:
  """`[config.yml] [key=value ...]` -> a validated RunConfig (nothing written)."""
  args = list(args)
  config_path = resolve_config_path(args.pop(0)) if args and "=" not in args[0] else DEFAULT_CONFIG
  if not config_path.is_file():
    raise ConfigError(f"config file not found: {config_path}")
  origins: dict[str, str] = {}
  from_file = load_yaml_chain(config_path, origins=origins)
  from_cli = parse_overrides(args)
  if BASE_CONFIG_KEY in from_cli:  # only files chain; on the command line upstream would ignore it
    raise ConfigError(f"'{BASE_CONFIG_KEY}={from_cli[BASE_CONFIG_KEY]}' on the command line is ignored by upstream: "
                      "pass the config file as the first argument, or put base_config: in a file")
  merged = {**from_file, **from_cli}
  origins.update((k, "command line") for k in from_cli)

  fork_keys = set(ForkConfig.model_fields)
  up_fields = upstream_fields()
  ours, theirs = {}, {}
  for key, value in merged.items():
    if key in fork_keys:
      ours[key] = value
    elif key in up_fields:
      _check_upstream_type(key, value, up_fields[key], origins[key])
      theirs[key] = value
    else:
      raise _unknown_key_error(key, origins[key], sorted(fork_keys | set(up_fields)))
  try:
    fork = ForkConfig(**ours)
  except pydantic.ValidationError as e:
    raise _fork_error(e, origins) from None
  check_moe_keys(fork, origins)
  problem, theirs = overflow.upstream_keys(fork, theirs, origins)
  if problem:
    raise ConfigError(problem)
  theirs = node_limited_groups(fork, theirs)
  _router_checks(fork, theirs, origins)
  if fork.moe_profile_every_n_steps and theirs.get("profiler"):
    raise ConfigError(f"config keys 'moe_profile_every_n_steps' = {fork.moe_profile_every_n_steps} "
                      f"({origins['moe_profile_every_n_steps']}) and 'profiler' = {theirs['profiler']!r} "
                      f"({origins['profiler']}) contradict each other: one profiler trace at a time; unset one")
  if "num_slices" not in merged and (slices := recipe_num_slices(fork, theirs)):
    theirs["num_slices"] = slices  # print-config names its source (MaxText/config_report.py)
  if fork.moe_log_expert_load and fork.moe_block != "ours":
    raise ConfigError(f"config key 'moe_log_expert_load' = True ({origins['moe_log_expert_load']}): "
                      "only our block reports the expert load; set moe_block=ours")
  return RunConfig(
      config_path=config_path.resolve(),
      fork=fork,
      upstream=local_first_defaults(moe_gmm_upstream_keys(fork, theirs, origins), config_path),
      explicit=frozenset(merged),
      origins=origins,
  )
