"""`consulrun acl-policy`: print the least-privilege ACL policy the nodes need."""

from __future__ import annotations

from pathlib import Path

import click

from consulrun.commands.common import read_manifest
from consulrun.commands.options import KvPrefix


@click.command("acl-policy")
@click.argument("manifest", required=False, type=click.Path(allow_dash=True, path_type=Path))
@click.option("--prefix", type=KvPrefix(), default=None,
              help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
def acl_policy(manifest: Path | None, prefix: str | None) -> None:
    """Print the least-privilege Consul ACL policy (HCL) the nodes need. MANIFEST may be - (standard input)."""
    from consulrun.protocol.aclpolicy import policy_hcl

    loaded = read_manifest(manifest)[0] if manifest else None
    kv_prefix = prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")
    # A bound check may be a service check; reading those needs service read, so grant it only then.
    service_checks = bool(loaded) and any(job.lock.checks for job in loaded.jobs)
    click.echo(policy_hcl(kv_prefix, service_checks=service_checks,
                          health_checks=bool(loaded) and loaded.health_checks), nl=False)
