"""A run's configuration: our keys and upstream's loaded from a YAML chain and the command line (load), checked
before anything is compiled (checks, data_checks, moe_keys, mesh), the XLA presets, the run's environment, and what
`--print-config` / `--dry-run` print (report).

The names every caller uses are re-exported here: `from MaxText import config; config.load([...])`.
"""

from MaxText.config.keys import ConfigError, ForkConfig, upstream_configs_dir, upstream_fields
from MaxText.config.loader import (DEFAULT_CONFIG, REPO_CONFIGS, RunConfig, cli_value, load, load_yaml_chain,
                                 parse_overrides, resolve_config_path)
from MaxText.config.moe_keys import MOE_GMM_UPSTREAM_KEYS, UPSTREAM_V3_ROUTER_MODEL_PREFIXES

__all__ = ["ConfigError", "DEFAULT_CONFIG", "cli_value", "ForkConfig", "MOE_GMM_UPSTREAM_KEYS", "REPO_CONFIGS", "RunConfig", "load",
           "load_yaml_chain", "parse_overrides", "resolve_config_path", "UPSTREAM_V3_ROUTER_MODEL_PREFIXES",
           "upstream_configs_dir", "upstream_fields"]
