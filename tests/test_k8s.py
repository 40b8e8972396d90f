"""The Kubernetes manifests: schema-valid, and each pod finds the job and its config.

Schemas: kubernetes-validate's for Kubernetes 1.33 (K8S_VERSION), strict
(unknown fields rejected). JobSet is a custom resource, for which
kubernetes-validate has no schema: its Job template is validated as the
batch/v1 Job the JobSet controller creates from it, and the JobSet fields we
use are checked against the v1alpha2 API's names and types here.
"""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from MaxText import config as fork_config
from MaxText import launch

K8S_VERSION = "1.33.0"  # what current managed clusters run; JobSet v0.8+ supports it
MANIFESTS = {"jobset": REPO / "scripts/k8s/jobset.yaml", "indexed-job": REPO / "scripts/k8s/indexed-job.yaml"}
IMAGE_USER = 10001  # docker/Dockerfile's USER


def _docs(name: str) -> list[dict]:
  return list(yaml.safe_load_all(MANIFESTS[name].read_text()))


def _job(name: str) -> dict:
  """The batch/v1 Job each manifest makes (the JobSet's controller makes it from the template)."""
  if name == "indexed-job":
    return next(d for d in _docs(name) if d["kind"] == "Job")
  (jobset,) = _docs(name)
  (rjob,) = jobset["spec"]["replicatedJobs"]
  return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{jobset['metadata']['name']}-{rjob['name']}-0"},
          "spec": rjob["template"]["spec"]}


def _coordinator_host(name: str) -> str:
  """Pod 0's DNS name, from the manifest's own names."""
  if name == "indexed-job":
    job = _job(name)
    return f"{job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}"
  (jobset,) = _docs(name)
  return f"{jobset['metadata']['name']}-{jobset['spec']['replicatedJobs'][0]['name']}-0-0.{jobset['metadata']['name']}"


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_is_schema_valid(name):
  docs = [_job(name)] + [d for d in _docs(name) if d["kind"] not in ("Job", "JobSet")]
  for doc in docs:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_schema_error_is_caught():
  job = _job("jobset")
  job["spec"]["template"]["spec"]["containers"][0]["resources"]["limitz"] = {}
  with pytest.raises(kubernetes_validate.ValidationError):
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_jobset_fields_restart_the_group_and_make_the_service():
  (jobset,) = _docs("jobset")
  assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and set(jobset) == {"apiVersion", "kind", "metadata", "spec"}
  spec = jobset["spec"]
  assert set(spec) == {"failurePolicy", "network", "replicatedJobs"}
  assert isinstance(spec["failurePolicy"]["maxRestarts"], int) and spec["failurePolicy"]["maxRestarts"] > 0
  assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
  (rjob,) = spec["replicatedJobs"]
  assert set(rjob) == {"name", "replicas", "template"} and rjob["replicas"] == 1


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_each_pod_finds_the_job_its_config_and_can_write(name, tmp_path, monkeypatch):
  job_spec = _job(name)["spec"]
  pod = job_spec["template"]["spec"]
  (container,) = pod["containers"]
  env = {e["name"]: e["value"] for e in container["env"]}
  nodes = job_spec["completions"]
  assert job_spec["completionMode"] == "Indexed" and job_spec["parallelism"] == nodes
  assert container["command"] == ["python3", "-m", "MaxText.train"]

  # Kubernetes sets JOB_COMPLETION_INDEX in each pod of an Indexed Job.
  info = launch.discover({**env, "JOB_COMPLETION_INDEX": "5"})
  assert info == launch.ProcessInfo("k8s", f"{_coordinator_host(name)}:12345", nodes, 5, None)

  # The image's working directory has no configs/: the package's copy is used.
  monkeypatch.chdir(tmp_path)
  recipe = fork_config.resolve_config_path(container["args"][0])
  assert recipe.is_file() and recipe.is_relative_to(fork_config.REPO_CONFIGS)
  assert yaml.safe_load(recipe.read_text())["recipe_num_gpus"] == nodes * container["resources"]["limits"]["nvidia.com/gpu"]

  security = pod["securityContext"]
  assert security["runAsUser"] == security["fsGroup"] == IMAGE_USER
  assert "run_name=" in " ".join(container["args"])  # fixed, so a restarted pod resumes
  registry, _, rest = container["image"].partition("/")
  assert "." in registry and re.fullmatch(r"[\w./-]+:[\w.-]+", rest) and not rest.endswith(":latest"), container["image"]
