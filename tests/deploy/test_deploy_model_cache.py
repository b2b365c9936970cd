"""The chart's model cache (values.yaml ``modelCache``): pagedkv's cache directory on a volume, so a
model is converted (or downloaded) once, not at every pod start. And the image: built and started
only where a Docker engine holds its base image already (skipped with the reason otherwise)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy import CHART, DEPLOY, render_chart

from pagedkv.paths import cache_root

IMAGE_CACHE = "/opt/pagedkv/cache"  # deploy/Dockerfile's PAGEDKV_CACHE_DIR


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _cache_wiring(pod: dict[str, Any], cache_dir: str) -> None:
    """The server sees the volume as its cache (PAGEDKV_CACHE_DIR, HF_HUB_CACHE inside it) and an
    init container seeds it from the image's cache without overwriting."""
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PAGEDKV_CACHE_DIR"] == cache_dir and env["HF_HUB_CACHE"] == cache_dir + "/hub"
    assert {"name": "model-cache", "mountPath": cache_dir} in container["volumeMounts"]
    (init,) = pod["initContainers"]
    assert init["image"] == container["image"] and {"name": "model-cache", "mountPath": cache_dir} in init[
        "volumeMounts"]
    assert init["command"][:2] == ["python", "-c"] and "copytree" in init["command"][2]
    assert init["command"][3:] == [IMAGE_CACHE, cache_dir]


def test_the_image_cache_dir_is_the_dockerfiles() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"PAGEDKV_CACHE_DIR={IMAGE_CACHE}" in dockerfile
    assert yaml.safe_load((CHART / "values.yaml").read_text())["image"]["cacheDir"] == IMAGE_CACHE


def test_seeding_copies_the_image_cache_and_keeps_what_is_there(tmp_path: Path) -> None:
    """The init container's command, run here: new files arrive, a file already in the volume (a
    model an earlier start converted) is not overwritten."""
    image, volume = tmp_path / "image-cache", tmp_path / "volume"
    (image / "native" / "k").mkdir(parents=True)
    (image / "native" / "k" / "lib.so").write_text("image")
    (image / "gguf").mkdir()
    (image / "gguf" / "converted").write_text("image")
    (volume / "gguf").mkdir(parents=True)
    (volume / "gguf" / "converted").write_text("kept")
    command = render_chart({})["StatefulSet/pagedkv"]["spec"]["template"]["spec"]["initContainers"][0]["command"]
    subprocess.run([sys.executable, *command[1:3], str(image), str(volume)], check=True, timeout=30)
    assert (volume / "native" / "k" / "lib.so").read_text() == "image"
    assert (volume / "gguf" / "converted").read_text() == "kept"


def test_statefulset_gives_each_replica_a_model_cache_claim() -> None:
    objs = render_chart({"replicaCount": 2, "modelCache": {"persistence": {"size": "30Gi"}}})
    statefulset = objs["StatefulSet/pagedkv"]
    _cache_wiring(_pod(statefulset), "/var/cache/pagedkv/models")
    (claim,) = [c for c in statefulset["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == "model-cache"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "30Gi"
    assert not any(k.startswith("PersistentVolumeClaim/") for k in objs)


def test_deployment_mounts_one_claim_the_chart_keeps() -> None:
    """Without the disk tier (a Deployment), the chart makes one claim, kept by Helm on uninstall,
    and replaces the pod with Recreate (a ReadWriteOnce claim is one node's)."""
    objs = render_chart({"kvDiskTier": {"enabled": False}, "modelCache": {"dir": "/cache"}})
    deployment = objs["Deployment/pagedkv"]
    _cache_wiring(_pod(deployment), "/cache")
    claim = objs["PersistentVolumeClaim/pagedkv-model-cache"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (volume,) = [v for v in _pod(deployment)["volumes"] if v["name"] == "model-cache"]
    assert volume["persistentVolumeClaim"] == {"claimName": "pagedkv-model-cache"}
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    # An existing claim instead: no claim of the chart's.
    objs = render_chart({"kvDiskTier": {"enabled": False}, "replicaCount": 3,
                         "modelCache": {"persistence": {"existingClaim": "shared", "accessModes": ["ReadWriteMany"]}}})
    (volume,) = [v for v in _pod(objs["Deployment/pagedkv"])["volumes"] if v["name"] == "model-cache"]
    assert volume["persistentVolumeClaim"] == {"claimName": "shared"}
    assert not any(k.startswith("PersistentVolumeClaim/") for k in objs)


def test_chart_refuses_replicas_sharing_a_read_write_once_cache() -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="modelCache: the chart's one claim"):
            chart.render({"replicaCount": 2, "kvDiskTier": {"enabled": False}}, name="pagedkv", namespace="pagedkv")


def test_model_cache_off_leaves_the_image_cache() -> None:
    objs = render_chart({"modelCache": {"enabled": False}})
    pod = _pod(objs["StatefulSet/pagedkv"])
    (container,) = pod["containers"]
    assert "initContainers" not in pod and "PAGEDKV_CACHE_DIR" not in {e["name"] for e in container["env"]}
    assert [c["metadata"]["name"] for c in objs["StatefulSet/pagedkv"]["spec"]["volumeClaimTemplates"]] == [
        "kv-disk-tier"]


def test_readme_says_how_to_size_memory() -> None:
    text = (DEPLOY / "README.md").read_text()
    assert "## Sizing memory" in text and "pagedkv size" in text and "resources.limits.memory" in text


# ------------------------------------------------------------------ the image

def _base_image() -> str:
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG PYTHON_IMAGE="):
            return line.split("=", 1)[1]
    raise AssertionError("deploy/Dockerfile names no PYTHON_IMAGE")


def _image_skip_reason() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no docker command on this machine"
    info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return f"no Docker engine answers ({(info.stderr.strip().splitlines() or ['docker info failed'])[-1]})"
    base = _base_image()
    if subprocess.run([docker, "image", "inspect", base], capture_output=True, timeout=60).returncode != 0:
        return f"the base image {base} is not on this machine (the test pulls nothing)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_image_builds_and_serves() -> None:
    """docker build of deploy/Dockerfile (with the base image present; its packages from the
    package index) and a container that answers /health. Skipped, saying why, without a Docker
    engine or the base image."""
    reason = _image_skip_reason()
    if reason:
        pytest.skip(reason)
    import httpx

    root = DEPLOY.parent
    tag = "pagedkv-test:ci"
    subprocess.run(["docker", "build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(root)], check=True,
                   timeout=1500)
    name = f"pagedkv-test-{os.getpid()}"
    subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "-p", "127.0.0.1::8000", tag], check=True,
                   timeout=60)
    try:
        port = subprocess.run(["docker", "port", name, "8000"], capture_output=True, text=True, check=True,
                              timeout=30).stdout.split(":")[-1].strip()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            raise AssertionError("the container never answered /health")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def test_cache_root_is_what_the_chart_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", "/var/cache/pagedkv/models")
    assert str(cache_root()) == "/var/cache/pagedkv/models"
