"""`mcp-ha`: the kit's one command.

    mcp-ha stack up -d --server my_project.server    the local stack
    mcp-ha check URL --shape ha_shape.py ...          the HA check against any deployment
    mcp-ha deploy compose|kubernetes DIR              the kit's compose files or manifests, written out

Each subcommand is imported when it is named, so `mcp-ha check --help` answers
at once. All of them need the `ops` extra (`mcp_ha.ops.main` says so if it is missing).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click

SUBCOMMANDS = {
    "stack": ("mcp_ha.ops.stack", "cli", "the local stack: redis, replicas and haproxy as processes"),
    "check": ("mcp_ha.ops.check.cli", "check", "the HA check: a deployment's guarantees, under faults"),
    "deploy": ("mcp_ha.ops.deploy_files", "cli", "the compose files or Kubernetes manifests, written into a directory"),
}


class _Lazy(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in SUBCOMMANDS:
            return None
        module, attr, _help = SUBCOMMANDS[cmd_name]
        try:
            command = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            raise click.ClickException(f"`mcp-ha {cmd_name}` needs {exc.name}: pip install 'mcp-ha-kit[ops]'") from exc
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_m, _a, help_) in SUBCOMMANDS.items()])

    def main(  # type: ignore[override]  # click's overloads: standalone_mode is always False here
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> NoReturn:
        """Click's own, but Ctrl-C exits 130 (128 + SIGINT), as shells, pytest and docker compose do: 1 is a
        broken promise to `mcp-ha check`, and a CI job must tell the two apart."""
        extra.pop("standalone_mode", None)
        try:
            code = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(INTERRUPTED)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


# The exit status of a run stopped with Ctrl-C.
INTERRUPTED = 130


@click.group(cls=_Lazy)
@click.version_option(package_name="mcp-ha-kit", message="%(prog)s %(version)s")
def main() -> None:
    """High availability for stateful MCP servers."""


if __name__ == "__main__":
    main()
