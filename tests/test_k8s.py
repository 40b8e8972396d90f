"""The Kubernetes manifests: schema-valid, and each pod finds the job and its config.

Schemas: kubernetes-validate's for Kubernetes 1.33 (K8S_VERSION), strict
(unknown fields rejected). JobSet is a custom resource, for which
kubernetes-validate has no schema: its Job template is validated as the
batch/v1 Job the JobSet controller creates from it, and the JobSet fields we
use are checked against the v1alpha2 API's names and types here.

Each manifest is validated as the documented command renders it (NUM_NODES
through envsubst), and again with its `#key: value` placeholders uncommented
(the cluster-specific lines: nodeSelector, NCCL, RDMA, a checkout), so a
placeholder is valid YAML and schema the moment a user uncomments it. The
cluster templates agree on the save-grace period with scripts/slurm/train.sbatch.
"""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from MaxText import config as fork_config
from MaxText.run import launch

K8S_VERSION = "1.33.0"  # what current managed clusters run; JobSet v0.8+ supports it
MANIFESTS = {"jobset": REPO / "scripts/k8s/jobset.yaml", "indexed-job": REPO / "scripts/k8s/indexed-job.yaml"}
IMAGE_USER = 10001  # docker/Dockerfile's USER


NUM_NODES = 16  # what the manifests' documented command sets (NUM_NODES=16 envsubst '$NUM_NODES' ...)
SBATCH = REPO / "scripts/slurm/train.sbatch"


def _render(text: str, num_nodes: int = NUM_NODES) -> str:
  """What `NUM_NODES=<n> envsubst '$NUM_NODES'` makes of the manifest."""
  return text.replace("${NUM_NODES}", str(num_nodes))


def _uncommented(text: str) -> str:
  """The manifest with every placeholder (`#key: value`, no space after the #) uncommented in place."""
  return re.sub(r"^(\s*)#(?=\S)", r"\1", text, flags=re.M)


def _docs(name: str, placeholders: bool = False, num_nodes: int = NUM_NODES) -> list[dict]:
  text = MANIFESTS[name].read_text()
  return list(yaml.safe_load_all(_render(_uncommented(text) if placeholders else text, num_nodes)))


def _job(name: str, placeholders: bool = False, num_nodes: int = NUM_NODES) -> dict:
  """The batch/v1 Job each manifest makes (the JobSet's controller makes it from the template)."""
  if name == "indexed-job":
    return next(d for d in _docs(name, placeholders, num_nodes) if d["kind"] == "Job")
  (jobset,) = _docs(name, placeholders, num_nodes)
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


@pytest.mark.parametrize("placeholders", [False, True], ids=["as-shipped", "placeholders-uncommented"])
@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_is_schema_valid(name, placeholders):
  docs = [_job(name, placeholders)] + [d for d in _docs(name, placeholders) if d["kind"] not in ("Job", "JobSet")]
  for doc in docs:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_num_nodes_is_set_in_one_place(name):
  """The command's NUM_NODES is the pod count and the process count; nothing else in the manifest says it."""
  text = MANIFESTS[name].read_text()
  assert f"NUM_NODES={NUM_NODES} envsubst '$NUM_NODES' < scripts/k8s/{MANIFESTS[name].name} | kubectl apply -f -" in text
  body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
  assert re.findall(r"\$\{?\w+\}?", body) == ["${NUM_NODES}"] * 3  # pods, parallelism, processes; nothing else
  for nodes in (2, 64):
    spec = _job(name, num_nodes=nodes)["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert spec["completions"] == spec["parallelism"] == int(env["JAX_NUM_PROCESSES"]) == nodes


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_placeholders_for_the_cluster_and_the_code_source(name):
  """As shipped, the image's installed package runs; the placeholders name the GPU nodes, the fabric, the RDMA
  devices, and a checkout mounted where scripts/slurm/train.sbatch mounts one (REPO_MOUNT)."""
  shipped = _job(name)["spec"]["template"]["spec"]
  assert "workingDir" not in shipped["containers"][0] and "nodeSelector" not in shipped
  assert {v["name"] for v in shipped["volumes"]} == {"outputs", "shm"}

  pod = _job(name, placeholders=True)["spec"]["template"]["spec"]
  (container,) = pod["containers"]
  assert pod["nodeSelector"]
  env = {e["name"] for e in container["env"]}
  assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"} <= env
  assert any(r.startswith("rdma/") for r in container["resources"]["limits"])
  assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
  checkout_dir = re.search(r"^CHECKOUT_DIR=(\S+)", SBATCH.read_text(), re.M)[1]
  assert container["workingDir"] == checkout_dir
  assert {"name": "checkout", "mountPath": checkout_dir, "readOnly": True} in container["volumeMounts"]
  assert "checkout" in {v["name"] for v in pod["volumes"]}


def test_the_save_grace_period_agrees_across_the_cluster_templates():
  """SLURM's time-limit signal and Kubernetes' SIGTERM grace give the run the same time to save, and each file
  states why (one step plus one checkpoint save of the 671B recipes, plus margin)."""
  (sbatch,) = re.findall(r"^#SBATCH --signal=B:USR1@(\d+)$", SBATCH.read_text(), re.M)
  graces = {"train.sbatch": int(sbatch)}
  for name, path in MANIFESTS.items():
    graces[path.name] = _job(name)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
  assert len(set(graces.values())) == 1, graces
  for path in (SBATCH, *MANIFESTS.values()):
    text = " ".join(re.sub(r"^\s*#", "", line).strip() for line in path.read_text().splitlines())
    assert f"{graces['train.sbatch']} s is one step plus one checkpoint save of the 671B recipes" in text, path


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

  assert nodes == NUM_NODES
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
