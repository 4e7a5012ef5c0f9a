"""The cluster configs shipped in cluster/ (the AWS launcher's, KubeRay's, the runtime environment, the
A100 study they run), where they are and read as YAML."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
LAUNCHER = CLUSTER / "aws-p4d.yaml"
RAYCLUSTER = CLUSTER / "kuberay" / "raycluster.yaml"
RAYJOB = CLUSTER / "kuberay" / "rayjob.yaml"
RUNTIME_ENV = CLUSTER / "runtime_env.yaml"
CONSTRAINTS = CLUSTER / "constraints.txt"
README = CLUSTER / "README.md"
STUDY = "experiments/configs/study_a100.yaml"


def read_yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def read_docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def read_raycluster() -> dict:
    (doc,) = [d for d in read_docs(RAYCLUSTER) if d["kind"] == "RayCluster"]
    return doc
