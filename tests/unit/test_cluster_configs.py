"""The cluster configs in cluster/ agree with Ray, KubeRay, the package and the A100 study.

Fast and offline: no cluster, no network. The launcher YAML goes through Ray's own config
preparation and validator (the same calls `ray up` makes before it talks to AWS). What rayvit's capacity
check makes of these clusters: test_cluster_configs_capacity.py.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
from ray.runtime_env import RuntimeEnv

from rayvit.config import load_config, load_study

from helpers_cluster_files import (CLUSTER, CONSTRAINTS, LAUNCHER, RAYCLUSTER, RAYJOB, README, ROOT, RUNTIME_ENV, STUDY,
                                   read_docs, read_raycluster, read_yaml)

GPUS_PER_NODE = 8  # p4d.24xlarge: 8x A100
MIN_NODES, MAX_NODES = 1, 8
MLFLOW_URI = "http://127.0.0.1:5000"
STORAGE_MOUNT = "/mnt/rayvit"        # the shared file system on every node of both clusters
STORAGE = f"{STORAGE_MOUNT}/ray_results"
# rayproject/ray or rayproject/ray-ml, tag {version}[-py3x][-cpu|-gpu|-cuXXX][-arch].
IMAGE_RE = re.compile(r"^rayproject/ray(?:-ml)?:(?P<version>\d+\.\d+\.\d+)(?:-py3\d+)?(?:-(?:cpu|gpu|cu\d+))?")


def _gpu_worker_type(cfg: dict) -> dict:
    (worker,) = [t for name, t in cfg["available_node_types"].items() if name != cfg["head_node_type"]]
    return worker


def _gpu_group(rc: dict) -> dict:
    (group,) = rc["spec"]["workerGroupSpecs"]
    return group


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


# --------------------------------------------------------------------------------------------------
# Ray cluster launcher (AWS)


def test_launcher_config_passes_rays_own_validator():
    # What `ray up` does before contacting AWS: fill defaults, then validate against ray-schema.json.
    config = prepare_config(read_yaml(LAUNCHER))
    validate_config(config)


def test_launcher_validator_rejects_a_broken_copy():
    # Proves the validator above is live: a misspelt node-type field must be refused...
    config = read_yaml(LAUNCHER)
    _gpu_worker_type(config)["max_worker"] = 8
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))
    # ...and so must more guaranteed workers than the cluster may have.
    config = read_yaml(LAUNCHER)
    _gpu_worker_type(config)["min_workers"] = config["max_workers"] + 1
    with pytest.raises(ValueError, match="max_workers"):
        validate_config(prepare_config(config))


def test_launcher_has_cpu_head_and_1_to_8_p4d_workers_with_8_gpus_each():
    config = read_yaml(LAUNCHER)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert not head["node_config"]["InstanceType"].startswith(("p", "g"))  # no GPU instance family
    worker = _gpu_worker_type(config)
    assert worker["node_config"]["InstanceType"] == "p4d.24xlarge"
    assert worker["resources"]["GPU"] == GPUS_PER_NODE
    assert (worker["min_workers"], worker["max_workers"]) == (MIN_NODES, MAX_NODES)
    assert config["max_workers"] == MAX_NODES
    # After Ray's preparation the head may start no workers of its own type.
    prepared = prepare_config(read_yaml(LAUNCHER))
    assert prepared["available_node_types"][config["head_node_type"]]["max_workers"] == 0


def test_launcher_gives_gpu_workers_the_efa_and_nccl_environment():
    docker = read_yaml(LAUNCHER)["docker"]
    options = " ".join(docker.get("run_options", []) + docker.get("worker_run_options", []))
    env = dict(re.findall(r"--env\s+(\w+)=(\S+)", options))
    assert env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["NCCL_DEBUG"] == "WARN"
    assert "NCCL_SOCKET_IFNAME" in env
    assert "/opt/amazon/efa/lib" in env["LD_LIBRARY_PATH"]
    assert "--device=/dev/infiniband/uverbs0" in options
    interfaces = _gpu_worker_type(read_yaml(LAUNCHER))["node_config"]["NetworkInterfaces"]
    assert [i["InterfaceType"] for i in interfaces] == ["efa"] * 4  # p4d.24xlarge has 4 EFA cards


def test_launcher_installs_the_project_and_syncs_the_checkout():
    config = read_yaml(LAUNCHER)
    (remote,) = [remote for remote, local in config["file_mounts"].items() if local == "."]
    # setup_commands run on every node the autoscaler adds too: all of them install the pinned versions.
    assert any(cmd.strip() == f"pip install -c {remote}/cluster/constraints.txt -e {remote}"
               for cmd in config["setup_commands"])
    for heavy in (".venv", ".git", "mlflow.db"):
        assert heavy in config["rsync_exclude"]


def test_mlflow_server_listens_on_loopback_only():
    head_cmds = " ".join(read_yaml(LAUNCHER)["head_start_ray_commands"])
    (sidecar,) = [c for c in _containers(read_raycluster()["spec"]["headGroupSpec"]["template"])
                  if c["name"] == "mlflow"]
    for command in (head_cmds, " ".join(sidecar["command"] + sidecar["args"])):
        assert "mlflow server" in command
        invocation = command.split("mlflow server", 1)[1].split("ray start")[0]
        assert re.findall(r"--host\s+(\S+)", invocation) == ["127.0.0.1"]
        assert re.search(r"--port\s+5000\b", invocation)


# --------------------------------------------------------------------------------------------------
# KubeRay


def test_raycluster_manifest_has_required_fields():
    rc = read_raycluster()
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["kind"] == "RayCluster"
    assert rc["metadata"]["name"]
    spec = rc["spec"]
    major_minor = ".".join(ray.__version__.split(".")[:2])
    assert spec["rayVersion"].startswith(major_minor + "."), (spec["rayVersion"], ray.__version__)
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    head_containers = _containers(head["template"])
    assert head_containers[0]["name"] == "ray-head"  # KubeRay runs `ray start` in container 0
    for c in head_containers:
        assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {})
    # The MLflow volume claim referenced by the head pod is defined in the same file.
    claims = {v["persistentVolumeClaim"]["claimName"] for v in head["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    defined = {d["metadata"]["name"] for d in read_docs(RAYCLUSTER) if d["kind"] == "PersistentVolumeClaim"}
    assert claims and claims <= defined


def test_raycluster_gpu_group_has_8_gpus_per_pod_and_1_to_8_replicas():
    group = _gpu_group(read_raycluster())
    assert group["groupName"]
    assert (group["minReplicas"], group["maxReplicas"]) == (MIN_NODES, MAX_NODES)
    assert MIN_NODES <= group["replicas"] <= MAX_NODES
    assert isinstance(group["rayStartParams"], dict)
    (worker,) = _containers(group["template"])
    limits, requests = worker["resources"]["limits"], worker["resources"]["requests"]
    # Kubernetes requires GPU requests == limits; KubeRay derives --num-gpus from the limit.
    assert int(limits["nvidia.com/gpu"]) == GPUS_PER_NODE
    assert int(requests["nvidia.com/gpu"]) == GPUS_PER_NODE
    env = {e["name"]: e["value"] for e in worker.get("env", [])}
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_SOCKET_IFNAME"]


def test_rayjob_runs_the_a100_study_on_the_raycluster():
    (job,) = read_docs(RAYJOB)
    assert job["apiVersion"] == "ray.io/v1"
    assert job["kind"] == "RayJob"
    assert job["metadata"].get("name") or job["metadata"].get("generateName")
    spec = job["spec"]
    assert spec["entrypoint"].split() == ["python", "experiments/scaling.py", "--config", STUDY,
                                          "--set", f"launch.storage={STORAGE}"]
    # The job targets the RayCluster defined next to it (or brings its own cluster spec).
    if "clusterSelector" in spec:
        assert spec["clusterSelector"]["ray.io/cluster"] == read_raycluster()["metadata"]["name"]
        assert not spec.get("shutdownAfterJobFinishes")  # never tear down a shared cluster
    else:
        assert spec["rayClusterSpec"]["workerGroupSpecs"]


def test_rayjob_runtime_env_matches_cluster_runtime_env():
    (job,) = read_docs(RAYJOB)
    job_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    RuntimeEnv(**job_env)  # Ray's own type checks (pip list, env_vars as str -> str)
    file_env = read_yaml(RUNTIME_ENV)
    assert job_env["env_vars"] == file_env["env_vars"]
    assert job_env["working_dir"].endswith(".zip")  # a remote archive: kubectl cannot upload a dir
    # The pins come from cluster/constraints.txt at the very commit the archive holds.
    archive = re.fullmatch(r"https://github\.com/(?P<org>[^/]+)/rayvit/archive/(?P<commit>[^/]+)\.zip",
                           job_env["working_dir"])
    assert archive, job_env["working_dir"]
    assert job_env["pip"] == [f"-r https://raw.githubusercontent.com/{archive['org']}/rayvit/"
                              f"{archive['commit']}/cluster/constraints.txt"]


# --------------------------------------------------------------------------------------------------
# Runtime environment for `ray job submit`


def test_runtime_env_is_accepted_by_ray_job_submit_parsing():
    # The same parsing `ray job submit --working-dir . --runtime-env FILE` does, then Ray's checks.
    env = parse_runtime_env_args(runtime_env=str(RUNTIME_ENV), working_dir=".")
    RuntimeEnv(**env)
    assert env["working_dir"] == "."
    for heavy in (".venv", ".git", "mlflow.db"):
        assert any(pattern.strip("/") == heavy for pattern in env["excludes"]), heavy
    assert env["env_vars"]["MLFLOW_TRACKING_URI"] == MLFLOW_URI


def _pins() -> dict[str, str]:
    lines = [line.strip() for line in CONSTRAINTS.read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("#")]
    # One name==version per line, no extras or ranges: valid both as pip constraints (-c) and requirements.
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+-]*", pin) for pin in pins), pins
    return {pin.split("==")[0].lower(): pin.split("==")[1] for pin in pins}


def test_constraints_pin_every_dependency_within_its_range():
    from packaging.requirements import Requirement

    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
    pins = _pins()
    assert set(pins) == {d.name.lower() for d in dependencies}
    for d in dependencies:
        assert d.specifier.contains(pins[d.name.lower()]), (d, pins[d.name.lower()])
    # Ray is the cluster images' own (tests above tie the image tags to the installed Ray), and the
    # MLflow sidecar of the KubeRay head serves with the version the driver logs with.
    assert pins["ray"] == ray.__version__
    (sidecar,) = [c for c in _containers(read_raycluster()["spec"]["headGroupSpec"]["template"]) if c["name"] == "mlflow"]
    assert f'"mlflow=={pins["mlflow"]}"' in " ".join(sidecar["args"])


def test_runtime_env_installs_the_constraints_file():
    # `ray job submit` reads the file on the submitting machine (from the repository root).
    env = RuntimeEnv(**parse_runtime_env_args(runtime_env=str(RUNTIME_ENV), working_dir="."))
    packages = [p for p in env.to_dict()["pip"]["packages"] if p.strip() and not p.startswith("#")]
    assert {p.split("==")[0].lower(): p.split("==")[1] for p in packages} == _pins()


# --------------------------------------------------------------------------------------------------
# Versions, sizes and the study agree


def _image_tags() -> dict[str, list[str]]:
    docker = read_yaml(LAUNCHER)["docker"]
    launcher = [docker[k] for k in ("image", "head_image", "worker_image") if k in docker]
    rc = read_raycluster()["spec"]
    templates = [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]
    kuberay = [c["image"] for t in templates for c in _containers(t)]
    return {"launcher": launcher, "kuberay": kuberay}


def test_ray_image_tags_match_installed_ray():
    for where, images in _image_tags().items():
        assert images, f"no image in the {where} config"
        for image in images:
            match = IMAGE_RE.match(image)
            assert match, f"{where}: {image!r} is not a rayproject/ray[-ml]:<version>-... image"
            assert match["version"] == ray.__version__, (where, image, ray.__version__)
    assert read_raycluster()["spec"]["rayVersion"] == ray.__version__
    # GPU workers need a CUDA image.
    assert re.search(r"-(gpu|cu\d+)", read_yaml(LAUNCHER)["docker"].get("worker_image")
                     or read_yaml(LAUNCHER)["docker"]["image"])
    (worker,) = _containers(_gpu_group(read_raycluster())["template"])
    assert re.search(r"-(gpu|cu\d+)", worker["image"])


def test_both_clusters_span_8_to_64_gpus():
    worker = _gpu_worker_type(read_yaml(LAUNCHER))
    group = _gpu_group(read_raycluster())
    (pod,) = _containers(group["template"])
    launcher = (worker["resources"]["GPU"] * worker["min_workers"], worker["resources"]["GPU"] * worker["max_workers"])
    kuberay = (int(pod["resources"]["limits"]["nvidia.com/gpu"]) * group["minReplicas"],
               int(pod["resources"]["limits"]["nvidia.com/gpu"]) * group["maxReplicas"])
    assert launcher == kuberay == (8, 64)


def test_study_config_fits_the_clusters():
    path = ROOT / STUDY
    assert path.is_file(), f"{STUDY} (named by the RayJob and the README) does not exist"
    study = load_study(path)
    cfg = study.run
    assert cfg.parallel.use_gpu, "the A100 study must run one GPU per Ray Train worker"
    counts = list(study.sweep.worker_counts) if study.sweep.mode == "scaling" else [cfg.parallel.num_workers]
    max_gpus = GPUS_PER_NODE * MAX_NODES
    for n in counts:
        assert GPUS_PER_NODE * MIN_NODES <= n <= max_gpus, f"{n} workers outside 8..{max_gpus} GPUs"
    # One worker per GPU: a full node hosts 8 workers, so 8 x cpus_per_worker must fit its CPUs.
    worker_cpus = _gpu_worker_type(read_yaml(LAUNCHER))["resources"]["CPU"]
    (pod,) = _containers(_gpu_group(read_raycluster())["template"])
    pod_cpus = int(pod["resources"]["limits"]["cpu"])
    assert GPUS_PER_NODE * cfg.parallel.cpus_per_worker <= min(worker_cpus, pod_cpus)
    if cfg.parallel.accelerator_type:
        resources = _gpu_worker_type(read_yaml(LAUNCHER))["resources"]
        assert f"accelerator_type:{cfg.parallel.accelerator_type}" in resources


# --------------------------------------------------------------------------------------------------
# Token authentication and shared storage on every node


def test_launcher_turns_token_auth_on_for_every_node_with_a_token_it_distributes():
    config = read_yaml(LAUNCHER)
    docker = config["docker"]
    # run_options apply to the head's and the workers' containers alike (and to every `ray exec`).
    assert "--env RAY_AUTH_MODE=token" in docker["run_options"]
    for key in ("head_run_options", "worker_run_options"):
        assert not any("RAY_AUTH_MODE" in o for o in docker.get(key, [])), f"{key} overrides the auth mode"
    for cmd in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        assert "RAY_AUTH_MODE=disabled" not in cmd
    # The token: Ray's default token file on every node, copied from the operator's own ~/.ray, which
    # lies outside this repository (so it can never be committed) and is not under the synced checkout.
    mounts = config["file_mounts"]
    assert mounts.get("~/.ray/auth_token") == "~/.ray/auth_token"
    local = Path(mounts["~/.ray/auth_token"]).expanduser().resolve()
    assert ROOT not in local.parents
    # Ray's validator accepts it (test_launcher_config_passes_rays_own_validator) and `ray up` copies
    # file_mounts to the head and from there to every worker (cluster_synced via the bootstrap config).


def test_kuberay_turns_token_auth_on_for_every_node():
    spec = read_raycluster()["spec"]
    # KubeRay >= 1.5.1 (ray-operator/apis/ray/v1/raycluster_types.go: AuthOptions.Mode): the operator
    # generates the token Secret and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN on every Ray container, the
    # autoscaler and the RayJob submitter. It refuses the mode below Ray 2.52.
    assert spec["authOptions"] == {"mode": "token"}
    assert tuple(int(x) for x in spec["rayVersion"].split(".")) >= (2, 52, 0)
    # Nothing may switch it off again for one container.
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for c in (c for t in templates for c in _containers(t)):
        assert not any(e["name"] in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN") for e in c.get("env", [])), c["name"]


def test_no_auth_token_is_committed():
    token_value = re.compile(r"RAY_AUTH_TOKEN\s*[=:]\s*[\"']?[A-Za-z0-9+/_=-]{16,}")
    for path in list(CLUSTER.rglob("*")) + [ROOT / "README.md"]:
        if path.is_file():
            assert not token_value.search(path.read_text()), path
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:                      # not a git checkout (e.g. a job's working dir): skip
        assert not [f for f in tracked.stdout.split() if Path(f).name.startswith("auth_token")]


def test_launcher_mounts_shared_storage_on_every_node():
    config = read_yaml(LAUNCHER)
    init = " ".join(config["initialization_commands"])   # on each host, before its container starts
    assert re.search(rf"mount -t nfs4 .*fs-REPLACE_ME\.efs\.[a-z0-9-]+\.amazonaws\.com:/ {STORAGE_MOUNT}\b", init)
    assert f"--volume {STORAGE_MOUNT}:{STORAGE_MOUNT}" in config["docker"]["run_options"]


def test_kuberay_mounts_one_readwritemany_volume_on_every_pod():
    rc = read_raycluster()
    (claim,) = [d for d in read_docs(RAYCLUSTER) if d["kind"] == "PersistentVolumeClaim"
                and d["spec"]["accessModes"] == ["ReadWriteMany"]]
    name = claim["metadata"]["name"]
    templates = [rc["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    for template in templates:
        volumes = {v["name"] for v in template["spec"]["volumes"]
                   if v.get("persistentVolumeClaim", {}).get("claimName") == name}
        ray_container = _containers(template)[0]          # KubeRay runs Ray in container 0
        mounts = {m["mountPath"] for m in ray_container.get("volumeMounts", []) if m["name"] in volumes}
        assert mounts == {STORAGE_MOUNT}, ray_container["name"]


def test_the_documented_commands_set_the_shared_storage():
    readme = README.read_text()
    assert f"--set launch.storage={STORAGE}" in readme
    assert load_config(ROOT / STUDY, [f"launch.storage={STORAGE}"]).launch.storage == STORAGE


# --------------------------------------------------------------------------------------------------
# Documentation and hygiene


def test_readme_has_the_commands_and_explains_every_placeholder():
    readme = README.read_text()
    for command in ("ray up cluster/aws-p4d.yaml", "ray dashboard cluster/aws-p4d.yaml",
                    "--runtime-env cluster/runtime_env.yaml", f"--config {STUDY}",
                    "ray down cluster/aws-p4d.yaml", "kubectl apply -f cluster/kuberay/raycluster.yaml",
                    "kubectl create -f cluster/kuberay/rayjob.yaml", "kubectl port-forward", "mlflow"):
        assert command in readme, command
    placeholders = set()
    for path in (LAUNCHER, RAYCLUSTER, RAYJOB, RUNTIME_ENV):
        placeholders |= set(re.findall(r"[\w.-]*REPLACE_ME[\w-]*", path.read_text()))
    for placeholder in placeholders:
        assert placeholder in readme, f"{placeholder} is not explained in cluster/README.md"


def test_cluster_files_hold_no_credentials():
    for path in CLUSTER.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"AKIA[0-9A-Z]{16}", text), path
            assert not re.search(r"aws_secret_access_key\s*[:=]\s*\S", text, re.I), path
            assert "BEGIN RSA PRIVATE KEY" not in text, path
