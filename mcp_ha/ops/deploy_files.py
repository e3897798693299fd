"""`mcp-ha deploy compose DIR`, `mcp-ha deploy kubernetes DIR`: the kit's deployment files, written out.

For a project that installs the kit rather than working in its checkout: the compose files or the
Kubernetes manifests, with the one haproxy.cfg they share and the kit's Redis functions, written in the
checkout's layout so every relative path in them holds. They run your image, not a copy of them:
compose takes MCP_IMAGE, a kustomize overlay of deploy/kubernetes its `images:` (docs/deploy.md).
"""

from __future__ import annotations

from pathlib import Path

import click

_PACKAGE = Path(__file__).resolve().parents[1]  # mcp_ha/, above this wing
# Installed, the wheel carries these files inside the package (mcp_ha/haproxy/, mcp_ha/deploy/); in
# a checkout they are the repository's own.
_INSTALLED = (_PACKAGE / "deploy").is_dir()

_HAPROXY = ("haproxy/haproxy.cfg", "haproxy/refuse_body.lua")
_REDIS_FUNCTIONS = ("deploy/redis/functions.lua", "deploy/redis/functions-cluster.lua")
# Redis Cluster's node and creation scripts, which the compose file mounts too.
_CLUSTER_SCRIPTS = ("deploy/kubernetes-cluster/node.sh", "deploy/kubernetes-cluster/create.sh")
# What an operator watches the kit with: alert rules, a Grafana dashboard, and for the Prometheus
# Operator the same rules and a ServiceMonitor (deploy/monitoring/kustomization.yaml).
_MONITORING = tuple(
    f"deploy/monitoring/{name}"
    for name in (
        "alerts.yaml",
        "grafana-dashboard.json",
        "kustomization.yaml",
        "prometheusrule.yaml",
        "servicemonitor.yaml",
    )
)
FILES = {
    "compose": (
        "docker-compose.yaml",
        "docker-compose.sentinel.yaml",
        "docker-compose.cluster.yaml",
        *_HAPROXY,
        *_REDIS_FUNCTIONS,
        *_CLUSTER_SCRIPTS,
        *_MONITORING,
    ),
    "kubernetes": (
        *(
            f"deploy/kubernetes/{name}"
            for name in ("kustomization.yaml", "redis.yaml", "mcp-server.yaml", "haproxy.yaml", "networkpolicy.yaml")
        ),
        *(
            f"deploy/kubernetes-sentinel/{name}"
            for name in (
                "kustomization.yaml",
                "mcp-server.yaml",
                "redis.yaml",
                "sentinel.yaml",
                "primary.sh",
                "redis.sh",
                "sentinel.sh",
            )
        ),
        *(
            f"deploy/kubernetes-cluster/{name}"
            for name in ("kustomization.yaml", "redis.yaml", "mcp-server.yaml", "create.yaml")
        ),
        *_CLUSTER_SCRIPTS,
        "deploy/redis/kustomization.yaml",
        *_REDIS_FUNCTIONS,
        "haproxy/kustomization.yaml",
        *_HAPROXY,
        *_MONITORING,
    ),
}
NEXT_STEPS = {
    "compose": (
        "Set HAPROXY_STATS_PASSWORD, REDIS_ADMIN_PASSWORD, REDIS_PASSWORD and REQUEST_STATE_KEYS, then:\n"
        "  MCP_IMAGE=your-image docker compose -f {dir}/docker-compose.yaml up -d\n"
        "(or, with your Dockerfile in {dir}, `docker compose up -d --build` there builds it)"
    ),
    "kubernetes": (
        "Write {dir}/deploy/kubernetes/secrets.env (its keys: deploy/kubernetes/kustomization.yaml), put an\n"
        "overlay naming your image beside it (images: [{{name: mcp-ha-kit, newName: ...}}]), then:\n"
        "  kubectl apply -k {dir}/deploy/your-overlay -n mcp\n"
        "With the Prometheus Operator: kubectl apply -k {dir}/deploy/monitoring -n mcp"
    ),
}


def source(path: str) -> Path:
    """Where the kit keeps the file that goes to `path` (in the checkout's layout)."""
    if not _INSTALLED:
        return _PACKAGE.parent / path
    # The wheel keeps haproxy/ and deploy/ as they are, and the compose files beside the manifests.
    return _PACKAGE / (path if path.startswith(("haproxy/", "deploy/")) else f"deploy/{path}")


def write(target: str, directory: Path, *, force: bool = False) -> list[tuple[str, str]]:
    """Write `target`'s files under `directory`: (path, "written" | "unchanged") each. A file there
    already that differs is left alone, and FileExistsError names every such file, unless `force`."""
    contents = {path: source(path).read_bytes() for path in FILES[target]}
    differing = [
        path
        for path, data in contents.items()
        if (directory / path).exists() and (directory / path).read_bytes() != data
    ]
    if differing and not force:
        raise FileExistsError(", ".join(differing))
    done = []
    for path, data in contents.items():
        out = directory / path
        if out.exists() and out.read_bytes() == data:
            done.append((path, "unchanged"))
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        done.append((path, "written"))
    return done


@click.command("deploy")
@click.argument("target", type=click.Choice(list(FILES)))
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite files in DIRECTORY that differ from the kit's.")
def cli(target: str, directory: Path, force: bool) -> None:
    """Write the kit's compose files or Kubernetes manifests (with haproxy.cfg) into DIRECTORY."""
    try:
        done = write(target, directory, force=force)
    except FileExistsError as exc:
        raise click.ClickException(
            f"these differ from the kit's, and were left as they are (--force overwrites): {exc}"
        ) from None
    for path, what in done:
        click.echo(f"{what:>9}  {directory / path}")
    click.echo("\n" + NEXT_STEPS[target].format(dir=directory))
