"""The Kubernetes manifests (deploy/kubernetes, and deploy/kubernetes-sentinel where it shares their
checks), statically: built the way kustomize builds them, validated against the Kubernetes schemas
kubernetes-validate bundles (strict: an unknown field fails), and held to what the kit needs of them;
then HAProxy's DNS discovery run live against replicas and a cluster DNS faked on loopback. No
cluster, no network; the haproxy.cfg checks need the haproxy binary, the comparison with real
kustomize needs kubectl, the live test root, unshare and 127.0.0.1:53."""

from __future__ import annotations

import ast
import base64
import copy
import csv
import inspect
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from test_compose import acl_users, instruction, interpolate, start_compose_redis, wait_for_pong

from mcp_ha.drain import Drain
from mcp_ha.ops.stack import http_status

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
# Both ways to apply the kit: with one Redis, and with Redis Sentinel (an overlay of the first).
KUSTOMIZATIONS = {
    "single": MANIFESTS,
    "sentinel": ROOT / "deploy" / "kubernetes-sentinel",
    "cluster": ROOT / "deploy" / "kubernetes-cluster",
}
# kustomization.yaml's secretGenerator reads this file, which the user writes and git ignores.
SECRETS_ENV = MANIFESTS / "secrets.env"
# Dummy values, as a user would write them: none may appear anywhere but in the Secret. The last
# two only the Sentinel overlay uses.
SECRETS = {
    "HAPROXY_STATS_PASSWORD": "test-stats-password",
    "REDIS_ADMIN_PASSWORD": "test-admin-password",
    "REDIS_PASSWORD": "test-kit-password",
    "REDIS_SENTINEL_AUTH_PASSWORD": "test-sentinel-password",
    "REDIS_REPLICATION_PASSWORD": "test-replication-password",
    "REQUEST_STATE_KEYS": "test-request-state-key-of-32-bytes-at-least",
}
# The oldest version whose schema has every field used (preStop `sleep`, on by default from 1.30),
# and the newest the package bundles.
KUBERNETES_VERSIONS = ["1.30", "1.37"]
NAMESPACE = "mcp"
HAPROXY = shutil.which("haproxy")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")
KUBECTL = shutil.which("kubectl")

# -- kustomize, for what the kit's kustomizations use ----------------------------------------------

# Anything else in a kustomization fails the build here rather than being ignored.
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "images", "configMapGenerator", "secretGenerator"}
# Lists a strategic merge patch merges item by item, by this key (the Kubernetes API's patchMergeKey),
# for the fields the kit's patches touch; any other list in a patch replaces the one it patches.
MERGE_KEYS = {"containers": "name", "env": "name", "volumeMounts": "name", "volumes": "name"}


def inside(path: Path, root: Path) -> Path:
    """kustomize's load restrictor: a kustomization reads files under its own directory only."""
    resolved = path.resolve()
    assert resolved.is_relative_to(root.resolve()), f"{path} is outside {root}: kustomize would refuse it"
    assert resolved.is_file(), f"{path} does not exist"
    return resolved


def read_env_file(text: str) -> dict[str, str]:
    """A secretGenerator `envs` file: KEY=value lines; blank lines and # comments skipped."""
    pairs = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"not KEY=value: {line!r}"
            pairs[key.strip()] = value
    return pairs


def build(directory: Path, given: dict[Path, str]) -> list[dict]:
    """`kustomize build directory`, without the hash suffix on generated names; `given` holds the
    contents of files the repository does not ship (the user's secrets.env)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= KUSTOMIZATION_KEYS, set(kustomization) - KUSTOMIZATION_KEYS
    assert kustomization.get("kind", "Kustomization") == "Kustomization"  # kustomize reads either
    objects = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            objects += build(path, given)
        else:
            objects += [doc for doc in yaml.safe_load_all(inside(path, directory).read_text()) if doc]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, patch
        for doc in yaml.safe_load_all(inside(directory / patch["path"], directory).read_text()):
            target = find(objects, doc["kind"], doc["metadata"]["name"])
            objects[objects.index(target)] = strategic_merge(target, doc)
    for image in kustomization.get("images", []):
        assert set(image) <= {"name", "newName", "newTag"}, image
        retag(objects, image)
    for generator in kustomization.get("configMapGenerator", []):
        assert set(generator) <= {"name", "files", "literals"}, generator
        data = {Path(f).name: inside(directory / f, directory).read_text() for f in generator.get("files", [])}
        data |= dict(literal.split("=", 1) for literal in generator.get("literals", []))
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    for generator in kustomization.get("secretGenerator", []):
        assert set(generator) <= {"name", "envs"}, generator
        data = {}
        for env_file in generator["envs"]:
            path = directory / env_file
            if path.resolve() in given:
                assert path.resolve().is_relative_to(directory.resolve())
                text = given[path.resolve()]
            else:
                text = inside(path, directory).read_text()
            data |= read_env_file(text)
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": generator["name"]},
                "type": "Opaque",
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
            }
        )
    return objects


def retag(objects: list[dict], image: dict[str, str]) -> None:
    """An `images:` entry: every container whose image is `name` (with any tag) gets the new name and tag."""
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            name, _, tag = c["image"].partition(":")
            if name == image["name"]:
                c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}".rstrip(":")


def strategic_merge(target, patch, field: str = ""):
    """kustomize's strategic merge, for what the kit's patches use: maps merged key by key, the
    MERGE_KEYS lists item by item (the patch's items first, as kustomize orders them), and anything
    else replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        return {**target, **{k: strategic_merge(target[k], v, k) if k in target else v for k, v in patch.items()}}
    if field in MERGE_KEYS and isinstance(target, list):
        key = MERGE_KEYS[field]
        old = {item[key]: item for item in target}
        patched = [strategic_merge(old[item[key]], item) if item[key] in old else item for item in patch]
        return patched + [item for item in target if item[key] not in {i[key] for i in patch}]
    return patch


def secrets_env_text(secrets: dict[str, str] = SECRETS) -> str:
    return "".join(f"{key}={value}\n" for key, value in secrets.items())


def build_kit(directory: Path) -> list[dict]:
    return build(directory, {SECRETS_ENV.resolve(): secrets_env_text()})


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    """The kit with one Redis."""
    return build_kit(MANIFESTS)


@pytest.fixture(scope="module", params=list(KUSTOMIZATIONS))
def each_kit(request) -> tuple[Path, list[dict]]:
    """Each kustomization a user applies, built: for what holds of both."""
    return KUSTOMIZATIONS[request.param], build_kit(KUSTOMIZATIONS[request.param])


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{len(matches)} {kind} named {name!r}"
    return matches[0]


def container(workload: dict, name: str | None = None) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    name = name or workload["metadata"]["name"]
    return next(c for c in containers if c["name"] == name)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion in env values and commands: $(NAME) from the variables before, $$ a $."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pod_env(objects: list[dict], workload: dict, name: str | None = None, *, ordinal: int = 0) -> dict[str, str]:
    """A container's environment as the kubelet would give it to pod `<workload>-<ordinal>` in NAMESPACE."""
    env: dict[str, str] = {}
    fields = {"metadata.name": f"{workload['metadata']['name']}-{ordinal}", "metadata.namespace": NAMESPACE}
    for source in container(workload, name).get("envFrom", []):
        env |= find(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
    for var in container(workload, name).get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = find(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            ref = source["secretKeyRef"]
            env[var["name"]] = base64.b64decode(find(objects, "Secret", ref["name"])["data"][ref["key"]]).decode()
    return env


def selects(selector: dict, labels: dict) -> bool:
    return set(selector) == {"matchLabels"} and selector["matchLabels"].items() <= labels.items()


def named_port(c: dict, port: int | str) -> int:
    return next(p["containerPort"] for p in c["ports"] if port in (p["name"], p["containerPort"]))


# -- the build -------------------------------------------------------------------------------------


# `kubectl ... rollout status kind/name ...` as the docs give it: each workload named must be the kit's.
ROLLOUT_STATUS = re.compile(r"kubectl\b[^\n]*?\brollout status ((?:\s*[a-z]+/[a-z0-9-]+)+)")
KINDS = {"deployment": "Deployment", "statefulset": "StatefulSet", "daemonset": "DaemonSet"}


@pytest.mark.quick
def test_every_rollout_status_in_the_docs_names_a_workload_of_its_kind(each_kit) -> None:
    """The quickstart waited on deployment/haproxy, a StatefulSet: kubectl failed there, on every cluster."""
    _, built = each_kit
    named = [
        tuple(workload.split("/"))
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for match in ROLLOUT_STATUS.finditer(path.read_text())
        for workload in match.group(1).split()
    ]
    assert named, "no rollout status in the docs"
    for kind, name in named:
        find(built, KINDS[kind], name)


def test_the_kustomization_builds_the_whole_kit(objects):
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} == {
        ("StatefulSet", "redis"),
        ("Service", "redis"),
        ("Deployment", "mcp-server"),
        ("Service", "mcp-server"),
        ("PodDisruptionBudget", "mcp-server"),
        ("StatefulSet", "haproxy"),
        ("Service", "haproxy"),
        ("Service", "haproxy-peers"),
        ("ConfigMap", "haproxy-config"),
        ("ConfigMap", "redis-functions"),
        ("ConfigMap", "mcp-settings"),
        ("Secret", "mcp-ha-kit-secrets"),
        *(("NetworkPolicy", name) for name in ("haproxy", "mcp-server", "redis", "sentinel")),
    }


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.quick
def test_every_object_is_valid_for_kubernetes(each_kit, version):
    _, objects = each_kit
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): {exc.message} "
                f"at {'.'.join(map(str, exc.path))}"
            )


@pytest.mark.quick
def test_the_validation_is_strict(objects):
    broken = copy.deepcopy(find(objects, "Deployment", "mcp-server"))
    container(broken)["readinessProbe"]["httpGet"]["pth"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError, match="pth"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.quick
def test_every_reference_names_an_object_and_key_that_exist(each_kit):
    _, objects = each_kit
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        for c in pod["containers"]:
            pod_env(objects, workload, c["name"])  # raises on a missing ConfigMap, Secret or key
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                find(objects, "ConfigMap", volume["configMap"]["name"])


needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: its kustomize checks what build() does here"
)


def by_id(objects: list[dict]) -> list[dict]:
    return sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"]))


def real_kustomize(directory: Path) -> list[dict]:
    """`kubectl kustomize directory`, its hash suffixes taken off the generated names (and the references to them)."""
    assert KUBECTL is not None
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    text = json.dumps(built)
    for obj in built:
        if obj["kind"] in ("ConfigMap", "Secret"):
            hashed = obj["metadata"]["name"]
            text = text.replace(f'"{hashed}"', f'"{hashed.rsplit("-", 1)[0]}"')
    return json.loads(text)


@needs_kubectl
@pytest.mark.process
def test_real_kustomize_builds_the_same_objects(each_kit, tmp_path):
    """kubectl's own kustomize, on a copy of the files it reads plus a secrets.env: the same objects."""
    directory, objects = each_kit
    for part in ("deploy", "haproxy"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns(SECRETS_ENV.name))
    (tmp_path / SECRETS_ENV.relative_to(ROOT)).write_text(secrets_env_text())
    assert by_id(real_kustomize(tmp_path / directory.relative_to(ROOT))) == by_id(objects)


# -- a server of one's own -------------------------------------------------------------------------

# An overlay as docs/deploy.md has a user write it, beside the files `mcp-ha deploy kubernetes DIR` writes.
OWN_IMAGE = ("registry.example/my-server", "1")
OWN_MODULE = "my_project.server"
OVERLAY = f"""\
resources: [../{{base}}]
images:
  - name: mcp-ha-kit
    newName: {OWN_IMAGE[0]}
    newTag: "{OWN_IMAGE[1]}"
patches:
  - path: module.yaml
"""
MODULE_PATCH = f"""\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: mcp-server
spec:
  template:
    spec:
      containers:
        - name: mcp-server
          env:
            - name: MCP_SERVER_MODULE
              value: {OWN_MODULE}
"""


def write_kit(directory: Path) -> None:
    """`mcp-ha deploy kubernetes directory`, and the secrets.env a user writes there."""
    from click.testing import CliRunner

    from mcp_ha.ops.cli import main

    result = CliRunner().invoke(main, ["deploy", "kubernetes", str(directory)])
    assert result.exit_code == 0, result.output
    (directory / SECRETS_ENV.relative_to(ROOT)).write_text(secrets_env_text())


@pytest.mark.process
def test_the_deploy_command_writes_every_file_the_kustomizations_read(tmp_path):
    """What `mcp-ha deploy kubernetes` writes is the repository's files, all of them: each kit builds
    from the written copy alone (build() refuses a file it lacks) into the same objects."""
    from mcp_ha.ops.deploy_files import FILES

    shipped = subprocess.run(
        [
            "git",
            "ls-files",
            "deploy/kubernetes",
            "deploy/kubernetes-sentinel",
            "deploy/kubernetes-cluster",
            "deploy/redis",
            "deploy/monitoring",
            "haproxy",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert shipped and set(FILES["kubernetes"]) == set(shipped)
    write_kit(tmp_path)
    for name, directory in KUSTOMIZATIONS.items():
        written = tmp_path / directory.relative_to(ROOT)
        assert by_id(build(written, {})) == by_id(build_kit(directory)), name


@pytest.mark.parametrize("base", list(KUSTOMIZATIONS))
@pytest.mark.process
def test_a_server_of_ones_own_is_an_overlay_naming_its_image_and_module(base, tmp_path):
    """The kit's objects, the replicas' image and module only changed: HAProxy and Redis keep theirs, the
    replicas every setting of the kit (Sentinel's too), and the result is valid Kubernetes."""
    write_kit(tmp_path)
    kit = KUSTOMIZATIONS[base]
    overlay = tmp_path / "deploy" / "my-server"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(OVERLAY.format(base=kit.name))
    (overlay / "module.yaml").write_text(MODULE_PATCH)
    objects, kit_objects = build(overlay, {}), build_kit(kit)
    deployment = find(objects, "Deployment", "mcp-server")
    assert container(deployment)["image"] == ":".join(OWN_IMAGE)
    env = pod_env(objects, deployment)
    assert env == {
        **pod_env(kit_objects, find(kit_objects, "Deployment", "mcp-server")),
        "MCP_SERVER_MODULE": OWN_MODULE,
    }
    # The kit names no module: the image's own (its MCP_SERVER_MODULE) serves unless an overlay sets one.
    assert "MCP_SERVER_MODULE" not in pod_env(kit_objects, find(kit_objects, "Deployment", "mcp-server"))
    others = [o for o in objects if o is not deployment]
    assert by_id(others) == by_id(
        [o for o in kit_objects if (o["kind"], o["metadata"]["name"]) != ("Deployment", "mcp-server")]
    )
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    if KUBECTL is not None:
        assert by_id(real_kustomize(overlay)) == by_id(objects)


# -- the replicas ----------------------------------------------------------------------------------


@pytest.mark.quick
def test_replicas_are_ready_on_health_and_alive_while_their_loop_answers(objects):
    deployment = find(objects, "Deployment", "mcp-server")
    c = container(deployment)
    env = pod_env(objects, deployment)
    readiness = c["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/health"
    assert named_port(c, readiness["port"]) == int(env["PORT"])
    # /health is 503 while Redis is down: a liveness probe on it would restart every replica for it. A TCP
    # probe passes a hung replica forever (its kernel still accepts): /livez answers from the event loop.
    liveness = c["livenessProbe"]["httpGet"]
    assert liveness["path"] == "/livez"
    assert named_port(c, liveness["port"]) == int(env["PORT"])
    assert env["HOST"] == "0.0.0.0", "a replica on loopback is unreachable from HAProxy's pod"


def uvicorn_graceful_shutdown_seconds() -> float:
    """The replicas' timeout_graceful_shutdown (HighAvailability.run): what open streams get once the drain is done."""
    tree = ast.parse((ROOT / "mcp_ha" / "replica.py").read_text())
    values = [
        kw.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg == "timeout_graceful_shutdown"
    ]
    assert len(values) == 1
    return values[0]


def test_the_grace_period_covers_the_drain(objects):
    pod = find(objects, "Deployment", "mcp-server")["spec"]["template"]["spec"]
    defaults = {name: p.default for name, p in inspect.signature(Drain).parameters.items()}
    drain_bound = defaults["timeout_seconds"] + defaults["notice_seconds"] + uvicorn_graceful_shutdown_seconds()
    c = container(find(objects, "Deployment", "mcp-server"))
    sleep = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod["terminationGracePeriodSeconds"] >= sleep + drain_bound


def test_the_replicas_identity_store_and_ttl(objects):
    deployment = find(objects, "Deployment", "mcp-server")
    env = pod_env(objects, deployment)
    assert env["INSTANCE_ID"] == "mcp-server-0", "each pod reports its own name"
    url = urlsplit(env["REDIS_URL"])
    redis = find(objects, "Service", url.hostname)
    labels = find(objects, "StatefulSet", "redis")["spec"]["template"]["metadata"]["labels"]
    assert redis["spec"]["selector"].items() <= labels.items()
    assert url.port == redis["spec"]["ports"][0]["port"] and url.password is None
    assert (env["REDIS_USERNAME"], env["REDIS_PASSWORD"]) == ("mcp", SECRETS["REDIS_PASSWORD"])
    haproxy_env = pod_env(objects, find(objects, "StatefulSet", "haproxy"))
    assert env["SESSION_TTL_SECONDS"] == haproxy_env["SESSION_TTL_SECONDS"], "one TTL for state and stick table"


@pytest.mark.quick
def test_replicas_run_as_the_dockerfiles_user_read_only(objects):
    pod = find(objects, "Deployment", "mcp-server")["spec"]["template"]["spec"]
    user, group = instruction("USER")[-1].split(":")
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (int(user), int(group))
    security = container(find(objects, "Deployment", "mcp-server"))["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]


def test_rollouts_and_evictions_keep_replicas_serving(objects):
    deployment = find(objects, "Deployment", "mcp-server")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] >= 3
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = find(objects, "PodDisruptionBudget", "mcp-server")
    assert selects(pdb["spec"]["selector"], labels)
    for other in ("haproxy", "redis"):
        workload = next(
            o for o in objects if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"] == other
        )
        assert not selects(pdb["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])
    budget = pdb["spec"].get("maxUnavailable", deployment["spec"]["replicas"] - pdb["spec"].get("minAvailable", 0))
    assert budget == 1


# -- HAProxy ---------------------------------------------------------------------------------------


def test_haproxys_config_is_the_repositorys_byte_for_byte(objects):
    data = find(objects, "ConfigMap", "haproxy-config")["data"]
    assert data == {
        "haproxy.cfg": (ROOT / "haproxy" / "haproxy.cfg").read_text(),
        "refuse_body.lua": (ROOT / "haproxy" / "refuse_body.lua").read_text(),
    }
    deployment = find(objects, "StatefulSet", "haproxy")
    env = pod_env(objects, deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container(deployment)["volumeMounts"]}
    # The image's default config path, and where haproxy.cfg looks for the Lua file.
    assert mounts["/usr/local/etc/haproxy"]["configMap"]["name"] == "haproxy-config"
    assert env["HAPROXY_LUA_DIR"] == "/usr/local/etc/haproxy"


def test_haproxy_finds_the_replicas_through_their_headless_service(objects):
    env = pod_env(objects, find(objects, "StatefulSet", "haproxy"))
    host, port = env["MCP_SERVER_DNS"].rsplit(":", 1)
    service_name, namespace, *domain = host.split(".")
    assert (namespace, domain) == (NAMESPACE, ["svc", "cluster", "local"]), "HAProxy's resolvers need the full name"
    service = find(objects, "Service", service_name)
    deployment = find(objects, "Deployment", "mcp-server")
    assert service["spec"]["clusterIP"] == "None", "a headless Service resolves to every pod"
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    # A draining pod stays resolvable until HAProxy's own check takes it out (drain.py).
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert int(port) == named_port(container(deployment), service["spec"]["ports"][0]["targetPort"])
    assert not any(re.fullmatch(r"MCP_SERVER_\d", key) for key in env)


def haproxy_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    # Only the pod's variables; the Lua file from where the ConfigMap takes it.
    return subprocess.run(
        [HAPROXY, "-c", "-f", str(ROOT / "haproxy" / "haproxy.cfg")],
        cwd=ROOT,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env, "HAPROXY_LUA_DIR": str(ROOT / "haproxy")},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture(scope="module")
def haproxy_env(objects) -> dict[str, str]:
    """Pod haproxy-0's environment as its command hands it to HAProxy (HAPROXY_LOCAL_PEER), its peers'
    names swapped for loopback: `haproxy -c` looks them up, and they resolve only in the cluster."""
    env = pod_env(objects, find(objects, "StatefulSet", "haproxy"))
    for key in ("HAPROXY_PEER_1", "HAPROXY_PEER_2"):
        env[key] = "127.0.0.1:" + env[key].rsplit(":", 1)[1]
    return {**env, "HAPROXY_LOCAL_PEER": "haproxy-1"}


def test_each_haproxy_pod_shares_its_session_table_with_the_other_by_its_stable_name(objects):
    statefulset = find(objects, "StatefulSet", "haproxy")
    peers = find(objects, "Service", "haproxy-peers")
    assert statefulset["spec"]["serviceName"] == "haproxy-peers" and statefulset["spec"]["replicas"] == 2
    # Looked up by HAProxy at start, before the pod is ready.
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    env = pod_env(objects, statefulset)
    for ordinal in (0, 1):
        host, port = env[f"HAPROXY_PEER_{ordinal + 1}"].rsplit(":", 1)
        assert host == f"haproxy-{ordinal}.haproxy-peers.{NAMESPACE}.svc.cluster.local"
        assert int(port) == named_port(container(statefulset), peers["spec"]["ports"][0]["targetPort"])


@pytest.mark.timeout(60)
@pytest.mark.process
def test_the_haproxy_command_names_its_peer_by_the_pods_ordinal(objects, tmp_path):
    """The StatefulSet's command, run here with a stand-in haproxy that prints what it was given: haproxy-1
    is peer haproxy-2, and HAProxy gets the config the ConfigMap mounts."""
    command = container(find(objects, "StatefulSet", "haproxy"))["command"]
    stand_in = tmp_path / "haproxy"
    stand_in.write_text('#!/bin/sh\necho "$HAPROXY_LOCAL_PEER $*"\n')
    stand_in.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOSTNAME": "haproxy-1",
        "HAPROXY_PEER_1": "localhost:10000",
        "HAPROXY_PEER_2": "localhost:10001",
    }
    script = [expand(part, {}) for part in command]
    done = subprocess.run(script, env=env, capture_output=True, text=True, timeout=30)
    assert done.stdout == "haproxy-2 -db -f /usr/local/etc/haproxy/haproxy.cfg\n", done.stderr


@needs_haproxy
@pytest.mark.haproxy
def test_haproxy_cfg_is_valid_with_the_deployments_environment(haproxy_env):
    # The name does not resolve here; HAProxy starts anyway (init-addr none) and finds the pods later.
    result = haproxy_check(haproxy_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Configuration file is valid" in result.stdout + result.stderr


@needs_haproxy
@pytest.mark.haproxy
def test_haproxy_cfg_reads_every_variable_the_deployment_sets(haproxy_env):
    """Poisoned one at a time, each variable must break the check (a misspelt name would be ignored)."""
    poison = {"HAPROXY_STATS_USER": "", "HAPROXY_STATS_PASSWORD": ""}
    # POD_NAMESPACE is the kubelet's, for MCP_SERVER_DNS; haproxy_check sets HAPROXY_LUA_DIR itself.
    for key in haproxy_env.keys() - {"POD_NAMESPACE", "HAPROXY_LUA_DIR"}:
        result = haproxy_check({**haproxy_env, key: poison.get(key, "127.0.0.1:notaport")})
        assert result.returncode != 0, f"haproxy.cfg ignores {key}"


@needs_haproxy
@pytest.mark.haproxy
def test_the_dns_branch_sits_beside_the_fixed_server_lines(haproxy_env):
    result = haproxy_check({**haproxy_env, "MCP_SERVER_1": "127.0.0.1:8001", "MCP_SERVER_DNS_SLOTS": "3"})
    assert result.returncode == 0, result.stdout + result.stderr
    result = haproxy_check({**haproxy_env, "MCP_SERVER_DNS_SLOTS": "none"})
    assert result.returncode != 0


def test_haproxy_listens_where_its_service_points(objects, haproxy_env):
    deployment = find(objects, "StatefulSet", "haproxy")
    service = find(objects, "Service", "haproxy")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: named_port(container(deployment), p["targetPort"]) for p in service["spec"]["ports"]}
    for name, variable in (("mcp", "HAPROXY_BIND"), ("stats", "HAPROXY_STATS_BIND")):
        address, port = haproxy_env[variable].rsplit(":", 1)
        assert address in ("", "*", "0.0.0.0", "::", "[::]") and int(port) == ports[name], variable
    assert haproxy_env["HAPROXY_STATS_PASSWORD"] == SECRETS["HAPROXY_STATS_PASSWORD"]


def test_haproxys_per_address_limits_are_the_local_stacks(haproxy_env):
    from mcp_ha.ops.stack import DEFAULT_MAX_CONN_PER_SOURCE, DEFAULT_RATE_LIMIT

    assert int(haproxy_env["HAPROXY_RATE_LIMIT"]) == DEFAULT_RATE_LIMIT
    assert int(haproxy_env["HAPROXY_MAX_CONN_PER_SOURCE"]) == DEFAULT_MAX_CONN_PER_SOURCE


# -- Redis -----------------------------------------------------------------------------------------


def redis_command(objects: list[dict]) -> list[str]:
    return container(find(objects, "StatefulSet", "redis"))["command"]


@pytest.mark.quick
def test_redis_has_the_kits_acl(objects):
    from mcp_ha.ops.stack import REDIS_KIT_ACL

    script = expand(redis_command(objects)[2], {})
    assert acl_users(script) == {"default": "~* &* +@all", "mcp": REDIS_KIT_ACL}


@pytest.mark.quick
def test_redis_persists_to_its_volume(objects):
    statefulset = find(objects, "StatefulSet", "redis")
    argv = expand(redis_command(objects)[2], {}).rstrip().splitlines()[-1].split()
    assert argv[argv.index("--appendonly") + 1] == "yes"
    # Bounded, within the container's memory limit, and full means writes refused, never live state evicted.
    assert (argv[argv.index("--maxmemory") + 1], argv[argv.index("--maxmemory-policy") + 1]) == ("256mb", "noeviction")
    assert container(statefulset)["resources"]["limits"]["memory"] == "512Mi"
    claims = {t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]}
    mounts = {m["mountPath"]: m["name"] for m in container(statefulset)["volumeMounts"]}
    assert mounts["/data"] in claims, "the append-only file must outlive the pod"
    # Ready on PONG only (an error while the AOF loads), asked as the admin.
    assert "redis-cli ping | grep -q PONG" in container(statefulset)["readinessProbe"]["exec"]["command"][-1]
    assert pod_env(objects, statefulset)["REDISCLI_AUTH"] == SECRETS["REDIS_ADMIN_PASSWORD"]


@pytest.mark.timeout(60)
@pytest.mark.redis
def test_the_redis_command_runs_with_its_acl(objects, tmp_path):
    """The StatefulSet's command, run here on loopback (compose's runner: compose and Kubernetes both
    read $$ as $, and this command has no other variable syntax of either)."""
    from conftest import free_ports

    from mcp_ha.ops.stack import redis_command as send

    command = redis_command(objects)
    assert expand(command[2], {}) == interpolate(command[2], {})
    env = pod_env(objects, find(objects, "StatefulSet", "redis"))
    (port,) = free_ports(1)
    proc = start_compose_redis(command, tmp_path, port, env)
    try:
        wait_for_pong(port, SECRETS["REDIS_ADMIN_PASSWORD"], tmp_path / "redis.log")
        assert str(send("127.0.0.1", port, "PING")).startswith("NOAUTH")
        kit = {"user": "mcp", "password": SECRETS["REDIS_PASSWORD"]}
        assert send("127.0.0.1", port, "HSET", "mcp:k8s", "n", "1", **kit) == 1
        assert str(send("127.0.0.1", port, "FLUSHALL", **kit)).startswith("NOPERM")
        assert not any(v in (tmp_path / "users.acl").read_text() for v in SECRETS.values())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- secrets ---------------------------------------------------------------------------------------


@pytest.mark.quick
def test_no_secret_value_outside_the_secret(each_kit):
    _, objects = each_kit
    for obj in objects:
        if obj["kind"] != "Secret":
            text = json.dumps(obj)
            assert not any(value in text for value in SECRETS.values()), f"{obj['kind']}/{obj['metadata']['name']}"
    assert set(read_env_file(secrets_env_text())) == set(SECRETS)
    # Every password reaches a container from the Secret, never as a value in the manifest.
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            for var in c.get("env", []):
                if re.search("PASSWORD|AUTH", var["name"]):
                    assert "secretKeyRef" in var.get("valueFrom", {}), f"{workload['metadata']['name']}: {var}"
            assert not any(v in json.dumps(c.get("command", [])) for v in SECRETS.values())


@pytest.mark.process
def test_the_repository_ships_no_secrets_file():
    tracked = subprocess.run(["git", "ls-files", "deploy"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert tracked and str(SECRETS_ENV.relative_to(ROOT)) not in tracked
    ignored = subprocess.run(["git", "check-ignore", "-q", str(SECRETS_ENV)], cwd=ROOT)
    assert ignored.returncode == 0, "secrets.env must be git-ignored"


# -- HAProxy's DNS discovery, live -----------------------------------------------------------------


class FakeClusterDns:
    """Kubernetes' DNS for one headless Service, on 127.0.0.1:53: A records for the pods listed."""

    def __init__(self, name: str) -> None:
        self.name = name.lower()
        self.addresses: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 53))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            (tid,) = struct.unpack(">H", query[:2])
            i, labels = 12, []
            while query[i]:
                labels.append(query[i + 1 : i + 1 + query[i]].decode())
                i += 1 + query[i]
            (qtype,) = struct.unpack(">H", query[i + 1 : i + 3])
            known = ".".join(labels).lower() == self.name
            records = [a for a in self.addresses if known and qtype == 1]
            answer = b"".join(b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 1, 4) + socket.inet_aton(a) for a in records)
            header = struct.pack(">HHHHHH", tid, 0x8180 | (0 if known else 3), 1, len(records), 0, 0)
            self.sock.sendto(header + query[12 : i + 5] + answer, peer)

    def close(self) -> None:
        self.sock.close()


def can_fake_cluster_dns() -> str | None:
    """Why the live DNS test cannot run here, or None: it needs port 53 and a private /etc/resolv.conf."""
    if HAPROXY is None:
        return "haproxy is not installed"
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare, to give HAProxy a resolv.conf of its own"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind(("127.0.0.1", 53))
        except OSError:
            return "127.0.0.1:53 is taken"
    return None


def pod_states(stats_url: str, password: str) -> dict[str, tuple[str, str]]:
    """HAProxy's DNS slots: name -> (status, address)."""
    from mcp_ha.ops.stack import read_stats_csv

    rows = csv.DictReader(read_stats_csv(stats_url, "stats", password).lstrip("# ").splitlines())
    return {row["svname"]: (row["status"], row["addr"]) for row in rows if row["svname"].startswith("mcp-pod-")}


def wait_for(condition, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(can_fake_cluster_dns() is not None, reason=str(can_fake_cluster_dns()))
@pytest.mark.timeout(90)
@pytest.mark.haproxy
@pytest.mark.slow
def test_haproxy_follows_the_pods_the_headless_service_resolves_to(haproxy_env, tmp_path):
    """HAProxy with the Deployment's settings and a cluster DNS faked on loopback: pods found as their
    addresses appear, a draining one taken out by HAProxy's own checks (which it counted, so it left
    in well under drain.py's notice bound) while still resolvable, and its slot emptied once it is not."""
    from conftest import free_ports

    http_port, stats_port, pod_port = free_ports(3)
    host = haproxy_env["MCP_SERVER_DNS"].rsplit(":", 1)[0]
    env = {
        **haproxy_env,
        "HAPROXY_BIND": f"127.0.0.1:{http_port}",
        "HAPROXY_STATS_BIND": f"127.0.0.1:{stats_port}",
        "MCP_SERVER_DNS": f"{host}:{pod_port}",
        "MCP_SERVER_DNS_SLOTS": "3",
        "HAPROXY_LUA_DIR": str(ROOT / "haproxy"),
    }
    (tmp_path / "resolv.conf").write_text("nameserver 127.0.0.1\n")
    pods = {
        ip: subprocess.Popen(
            [sys.executable, "server.py"],
            cwd=ROOT,
            stdout=open(tmp_path / f"{ip}.log", "wb"),
            stderr=subprocess.STDOUT,
            env={
                "PATH": os.environ["PATH"],
                "INSTANCE_ID": f"pod-{ip}",
                "HOST": ip,
                "PORT": str(pod_port),
                "LOG_FORMAT": "text",
            },
        )
        for ip in ("127.0.0.2", "127.0.0.3")
    }
    dns = FakeClusterDns(host)
    haproxy = None
    stats = f"http://127.0.0.1:{stats_port}/stats"
    password = env["HAPROXY_STATS_PASSWORD"]
    try:
        for ip in pods:
            # A loaded machine may take 20 s to import a server; the wait ends as soon as it answers.
            wait_for(
                lambda ip=ip: http_status(f"http://{ip}:{pod_port}/health") == 200, f"the replica on {ip}", timeout=60
            )
        dns.addresses = ["127.0.0.2"]
        # Its own mount namespace, where /etc/resolv.conf names the fake DNS; the host's is untouched.
        script = (
            f"mount --bind {tmp_path / 'resolv.conf'} /etc/resolv.conf && exec {HAPROXY} -db -f haproxy/haproxy.cfg"
        )
        haproxy = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", script],
            cwd=ROOT,
            env=env,
            stdout=open(tmp_path / "haproxy.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: http_status(stats) == 401, "HAProxy's stats port")
        up = wait_for(lambda: [a for s, a in pod_states(stats, password).values() if s == "UP"], "the first pod")
        assert up == [f"127.0.0.2:{pod_port}"]
        assert sum(s.startswith("MAINT") for s, _ in pod_states(stats, password).values()) == 2, "empty slots"

        dns.addresses = ["127.0.0.2", "127.0.0.3"]
        wait_for(
            lambda: (
                sorted(a for s, a in pod_states(stats, password).values() if s == "UP")
                == [f"127.0.0.2:{pod_port}", f"127.0.0.3:{pod_port}"]
            ),
            "a new pod found",
        )

        # Terminating, and still resolvable (publishNotReadyAddresses): HAProxy's checks take it out.
        draining = pods["127.0.0.3"]
        draining.terminate()
        assert draining.wait(timeout=Drain().timeout_seconds + Drain().notice_seconds + 5) == 0
        drained = re.search(r"drained in ([\d.]+) s", (tmp_path / "127.0.0.3.log").read_text())
        assert drained and float(drained.group(1)) < Drain().notice_seconds, "it did not see HAProxy's checks"
        slot = next(n for n, (_, a) in pod_states(stats, password).items() if a == f"127.0.0.3:{pod_port}")
        assert wait_for(lambda: pod_states(stats, password)[slot][0] == "DOWN", "the draining pod down")

        dns.addresses = ["127.0.0.2"]
        wait_for(lambda: pod_states(stats, password)[slot][0].startswith("MAINT"), "its slot emptied")
        assert http_status(f"http://127.0.0.1:{http_port}/health") == 200
    finally:
        dns.close()
        for proc in [haproxy, *pods.values()]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=20)


# -- NetworkPolicies (deploy/kubernetes/networkpolicy.yaml) -----------------------------------------
# Evaluated here as the NetworkPolicy API defines them, for the selectors the kit's use; never enforced on a
# cluster (none runs here).

# Who connects to what, by the destination pod's name label and port name, in every kit and in each one.
# "outside" is a client in another namespace; "prometheus" the Prometheus Operator's pods, in theirs.
# HAProxy's front door and stats page are open to every source.
OPEN_TO_ALL = {("haproxy", "mcp"), ("haproxy", "stats")}
EVERY_KIT_CONNECTS = {
    ("haproxy", "haproxy", "peers"),
    ("haproxy", "mcp-server", "http"),
    ("prometheus", "mcp-server", "http"),
    ("mcp-server", "redis", "redis"),
    # One policy serves the three kits: the rule that lets Sentinel's and Cluster's servers reach each other
    # admits this in the single kit too, where nothing uses it.
    ("redis", "redis", "redis"),
}
CONNECTS = {
    "single": EVERY_KIT_CONNECTS,
    "sentinel": EVERY_KIT_CONNECTS
    | {
        ("sentinel", "redis", "redis"),
        ("mcp-server", "sentinel", "sentinel"),
        ("redis", "sentinel", "sentinel"),  # primary.sh asks them for the primary at start
        ("sentinel", "sentinel", "sentinel"),
    },
    "cluster": EVERY_KIT_CONNECTS
    | {
        ("redis", "redis", "cluster-bus"),
        ("redis-cluster-create", "redis", "redis"),
    },
}
ELSEWHERE = {
    "outside": ("elsewhere", {"app": "a-client"}),
    "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
}


def _selected(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions), expressions
    return selector.get("matchLabels", {}).items() <= labels.items() and all(
        labels.get(e["key"]) in e["values"] for e in expressions
    )


def _peer_admits(peer: dict, namespace: str, labels: dict[str, str]) -> bool:
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
    if "namespaceSelector" in peer:
        assert peer["namespaceSelector"] == {}, peer  # any namespace: the only kind the kit's policies use
    elif namespace != NAMESPACE:
        return False  # a podSelector alone: pods of the policy's own namespace
    return _selected(peer.get("podSelector", {}), labels)


def admits(
    policies: list[dict], source: tuple[str, dict[str, str]], pod: dict[str, str], port: tuple[str, int]
) -> bool:
    """Whether a connection from `source` (namespace, labels) reaches `port` (name, number) of a pod labelled
    `pod`: open unless a policy selects the pod, then only as one of their ingress rules allows."""
    selecting = [p for p in policies if _selected(p["spec"]["podSelector"], pod)]
    assert all("Ingress" in p["spec"]["policyTypes"] for p in selecting)
    return not selecting or any(
        (not rule.get("ports") or any(p["port"] in port for p in rule["ports"]))
        and (not rule.get("from") or any(_peer_admits(peer, *source) for peer in rule["from"]))
        for policy in selecting
        for rule in policy["spec"].get("ingress", [])
    )


def pods(objects: list[dict]) -> dict[str, tuple[dict[str, str], set[tuple[str, int]]]]:
    """Each workload's pods, by their name label: their labels and their containers' (port name, number)."""
    found = {}
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")):
        template = workload["spec"]["template"]
        labels = template["metadata"]["labels"]
        ports = {(p["name"], p["containerPort"]) for c in template["spec"]["containers"] for p in c.get("ports", [])}
        found[labels["app.kubernetes.io/name"]] = (labels, ports)
    return found


@pytest.mark.quick
@pytest.mark.parametrize("kit", list(KUSTOMIZATIONS))
def test_network_policies_admit_each_kits_connections_and_nothing_else(kit):
    """Every source (each pod of the kit, a client elsewhere, Prometheus) against every port of every pod:
    admitted exactly when the kit makes that connection."""
    objects = build_kit(KUSTOMIZATIONS[kit])
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    kit_pods = pods(objects)
    sources = {name: (NAMESPACE, labels) for name, (labels, _) in kit_pods.items()} | ELSEWHERE
    admitted = {
        (source, name, port[0])
        for source, where in sources.items()
        for name, (labels, ports) in kit_pods.items()
        for port in ports
        if admits(policies, where, labels, port)
    }
    assert admitted == CONNECTS[kit] | {(source, *port) for source in sources for port in OPEN_TO_ALL}
    # And every pod serving a port is behind a policy: a workload added without one would be open to all.
    unguarded = [
        name
        for name, (labels, ports) in kit_pods.items()
        if ports and not any(_selected(p["spec"]["podSelector"], labels) for p in policies)
    ]
    assert unguarded == []
