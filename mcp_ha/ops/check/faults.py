"""The faults the HA check injects, as the user's own commands: a template per verb, `{replica}` in it.

    kill     kill -9 the replica (it is brought back with `restart`, or by the deployment itself)
    pause    freeze it (SIGSTOP): a hung replica
    resume   unfreeze it (SIGCONT)
    restart  start it again after a kill
    drain    SIGTERM it (it drains), then start it again

and two for the front door, whose commands name the balancer they fault themselves (no `{replica}`):

    kill-balancer     kill -9 one of the load balancers in front of the replicas, while another
                      serves the same URL
    restart-balancer  start it again

Ready-made sets: `local` (the local stack, `mcp-ha stack ...`; STACK_DIR says which; its first HAProxy,
when it runs more than one), `compose` (`docker compose`, v2, where the docker CLI has it, else v1's
`docker-compose`; or name one: `--faults "docker compose"`, `--faults docker-compose`; services
mcp-server-1..3 whose INSTANCE_ID is the service name, and haproxy beside haproxy-2: on one port with host
networking; with published ports the URL reaches one of them, and the check says so), `kubectl` (a pod
deleted at once, or with its grace period for a drain; Kubernetes starts another by itself and cannot pause
one; HAProxy's pod haproxy-0; `--faults "kubectl -n mcp"` in the namespace the docs deploy into, else the
current context's).
Or the user's own: `kill=kubectl delete pod --grace-period=0 --force {replica},drain=...`. A check whose
fault has no command is skipped, with the reason, never failed.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPLICA_VERBS = ("kill", "pause", "resume", "restart", "drain")
BALANCER_VERBS = ("kill-balancer", "restart-balancer")
VERBS = REPLICA_VERBS + BALANCER_VERBS
ONE_BALANCER = "the local stack runs one HAProxy (MCP_BALANCERS=1): killing it would take the front door out"
# One fault command may take this long (a drain waits for the replica's drain and its start).
COMMAND_TIMEOUT_SECONDS = 90.0


class FaultError(Exception):
    """A fault set that cannot be used (bad syntax, an unknown verb), or a fault command that failed."""


@dataclass(frozen=True)
class Faults:
    """Command templates by verb; `unavailable` says, per verb without a command, why."""

    name: str
    commands: Mapping[str, str]
    unavailable: Mapping[str, str] = field(default_factory=dict)
    # Extra environment for the commands (the local stack's STACK_DIR, say).
    env: Mapping[str, str] = field(default_factory=dict)

    def missing(self, *verbs: str) -> str | None:
        """Why one of `verbs` cannot be injected, or None when all can."""
        for verb in verbs:
            if verb not in self.commands:
                return self.unavailable.get(verb) or f"no {verb} command in the {self.name} faults"
        return None

    def command(self, verb: str, replica: str) -> list[str]:
        """The argv of `verb` for `replica` (the replica name quoted, whatever it holds)."""
        template = self.commands[verb]
        return shlex.split(template.replace("{replica}", shlex.quote(replica)))

    async def run(self, verb: str, replica: str) -> None:
        """Run `verb` on `replica`; FaultError with its output when it fails or takes too long."""
        argv = self.command(verb, replica)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **self.env},
            )
        except OSError as exc:
            raise FaultError(f"{verb} {replica}: cannot run {argv[0]}: {exc}") from exc
        try:
            async with asyncio.timeout(COMMAND_TIMEOUT_SECONDS):
                output, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()  # our own child
            await proc.wait()
            raise FaultError(
                f"{verb} {replica}: `{shlex.join(argv)}` took over {COMMAND_TIMEOUT_SECONDS:g} s"
            ) from None
        if proc.returncode != 0:
            text = output.decode(errors="replace").strip()[-400:]
            raise FaultError(f"{verb} {replica}: `{shlex.join(argv)}` exited {proc.returncode}: {text}")


def local(stack_dir: str | None = None) -> Faults:
    """The local stack's faults: `mcp-ha stack` (its module, run by this Python), in STACK_DIR or `stack_dir`."""
    from mcp_ha.ops.stack import Stack  # the stack's, only for this preset

    stack = f"{shlex.quote(sys.executable)} -m mcp_ha.ops.stack"
    commands = {
        "kill": f"{stack} kill -s SIGKILL {{replica}}",
        "pause": f"{stack} kill -s SIGSTOP {{replica}}",
        "resume": f"{stack} kill -s SIGCONT {{replica}}",
        "restart": f"{stack} restart {{replica}}",
        # `stack restart` is a SIGTERM (the replica drains), then a start, waiting until it is healthy.
        "drain": f"{stack} restart {{replica}}",
    }
    balancers = Stack.load(state_dir=Path(stack_dir) if stack_dir else None).config.balancer_names()
    unavailable = {}
    if len(balancers) > 1:
        commands |= {
            "kill-balancer": f"{stack} kill -s SIGKILL {balancers[0]}",
            "restart-balancer": f"{stack} start {balancers[0]}",
        }
    else:
        unavailable = dict.fromkeys(BALANCER_VERBS, ONE_BALANCER)
    return Faults("local", commands, unavailable, env={"STACK_DIR": stack_dir} if stack_dir else {})


def compose(command: str | None = None) -> Faults:
    """docker compose's faults: `command` ("docker compose" or "docker-compose"), else v2's `docker compose`
    where the docker CLI has it, else v1's `docker-compose` where that is installed."""
    base = command or _compose_command()
    return Faults(
        "compose",
        {
            "kill": f"{base} kill -s SIGKILL {{replica}}",
            "pause": f"{base} pause {{replica}}",
            "resume": f"{base} unpause {{replica}}",
            "restart": f"{base} start {{replica}}",
            "drain": f"{base} restart {{replica}}",
            "kill-balancer": f"{base} kill -s SIGKILL haproxy",
            "restart-balancer": f"{base} start haproxy",
        },
    )


def _compose_command() -> str:
    if shutil.which("docker"):
        try:
            found = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            found = False
        if found:
            return "docker compose"
    return "docker-compose" if shutil.which("docker-compose") else "docker compose"


def kubectl(namespace: str | None = None) -> Faults:
    """kubectl's faults, in `namespace` (else the current context's)."""
    base = "kubectl" if namespace is None else f"kubectl -n {shlex.quote(namespace)}"
    return Faults(
        "kubectl",
        {
            "kill": f"{base} delete pod --grace-period=0 --force {{replica}}",
            # Deleting a pod with its grace period is a SIGTERM; its Deployment starts another.
            "drain": f"{base} delete pod --wait=false {{replica}}",
            "kill-balancer": f"{base} delete pod --grace-period=0 --force haproxy-0",
        },
        unavailable={
            "pause": "kubectl cannot pause a pod's processes",
            "resume": "kubectl cannot pause a pod's processes",
            "restart": "Kubernetes starts a new pod by itself",
            "restart-balancer": "Kubernetes starts a new pod by itself",
        },
    )


# `kubectl -n NAMESPACE` (or --namespace NAMESPACE, --namespace=NAMESPACE), as kubectl itself takes it.
_KUBECTL = re.compile(r"kubectl(?:\s+(?:-n\s+|--namespace[=\s]+)([a-z0-9]([-a-z0-9]*[a-z0-9])?))?")

PRESETS = ("local", "compose", "kubectl")
# Longest first: kill-balancer is not kill followed by something else.
_ASSIGNMENT = re.compile(r"(?:^|,)\s*(" + "|".join(sorted(VERBS, key=len, reverse=True)) + r")\s*=")


def parse_faults(text: str) -> Faults:
    """A preset's name, or `verb=command` pairs separated by commas (a command may hold commas)."""
    text = " ".join(text.split())
    if text == "local":
        return local()
    if text == "compose":
        return compose()
    if text in ("docker compose", "docker-compose"):
        return compose(text)
    if namespaced := _KUBECTL.fullmatch(text):
        return kubectl(namespaced.group(1))
    starts = list(_ASSIGNMENT.finditer(text))
    if not starts or starts[0].start() != 0:
        raise FaultError(
            f"--faults {text!r}: one of {', '.join(PRESETS)}, or verb=command pairs (verbs: {', '.join(VERBS)})"
        )
    commands: dict[str, str] = {}
    for match, after in zip(starts, [*starts[1:], None], strict=True):
        verb = match.group(1)
        command = text[match.end() : after.start() if after else len(text)].strip()
        if verb in commands:
            raise FaultError(f"--faults: {verb} given twice")
        if not command:
            raise FaultError(f"--faults: {verb}= has no command")
        if "{replica}" not in command and verb in REPLICA_VERBS:
            raise FaultError(f"--faults: the {verb} command does not name {{replica}}: {command!r}")
        commands[verb] = command
    return Faults("custom", commands)
