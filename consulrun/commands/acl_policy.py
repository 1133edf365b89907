"""`consulrun acl-policy`: print the least-privilege ACL policy of a role (a node, an operator), or one for all."""

from __future__ import annotations

from pathlib import Path

import click

from consulrun.commands.common import read_manifest
from consulrun.commands.options import manifest_prefix_option
from consulrun.errors import UsageError


@click.command("acl-policy", short_help="Print the Consul ACL policy a node or an operator needs.")
@click.argument("manifest", required=False, type=click.Path(allow_dash=True, path_type=Path))
@manifest_prefix_option
@click.option("--node", "node", default=None, metavar="NAME",
              help="The policy of node NAME (its agent's node name): run, skip, take over, reap, and the watchdog "
                   "with health_checks; its sessions and its agent only.")
@click.option("--operator", is_flag=True,
              help="The policy of an operator: status, the exporter, history, logs, unlock, pause, resume, trigger, "
                   "forget.")
def acl_policy(manifest: Path | None, prefix: str | None, node: str | None, operator: bool) -> None:
    """Print the Consul ACL policy (HCL) of a role: --node NAME or --operator.

    Without either, one policy for a token that every command uses on every
    node (session write and agent read on all nodes). MANIFEST may be -
    (standard input).
    """
    from consulrun.protocol.aclpolicy import node_name_problem, policy_hcl

    if node is not None and operator:
        raise UsageError("--node and --operator are two roles: give one")
    if node is not None and node_name_problem(node):
        raise UsageError(f"--node: {node_name_problem(node)}")
    loaded = read_manifest(manifest)[0] if manifest else None
    kv_prefix = prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")
    # A bound check may be a service check; reading those needs service read, so grant it only then.
    service_checks = bool(loaded) and any(job.lock.checks for job in loaded.jobs)
    role = "node" if node is not None else ("operator" if operator else "all")
    click.echo(policy_hcl(kv_prefix, service_checks=service_checks,
                          health_checks=bool(loaded) and loaded.health_checks, role=role, node=node), nl=False)
