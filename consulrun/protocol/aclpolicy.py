"""The least-privilege Consul ACL policy a node running consulrun needs, as HCL."""

from __future__ import annotations


def policy_hcl(kv_prefix: str, service_checks: bool, health_checks: bool = False) -> str:
    """Rules for `run`, takeover and `status`: the job keys, sessions, and reads for node identity and checks.

    `run` reads the agent's own node name (agent read) and its checks (node
    read, service read when a service check is bound); `status` reads session
    and node health, which the same rules allow. With health checks, write on
    the prefix's external node and its service, by exact name: the finish sets
    a job's check (a service check: service write), the watchdog registers the
    node (node write). Nothing else is granted.
    """
    from consulrun.protocol.health import node_name

    prefix = kv_prefix.strip("/") + "/"
    rules = [
        f'# consulrun: what nodes need to run, take over and report jobs under "{prefix}"',
        f'key_prefix "{prefix}" {{\n  policy = "write"\n}}',
        'session_prefix "" {\n  policy = "write"\n}',
        'agent_prefix "" {\n  policy = "read"\n}',
        'node_prefix "" {\n  policy = "read"\n}',
    ]
    if service_checks:
        rules.append('service_prefix "" {\n  policy = "read"\n}')
    if health_checks:
        name = node_name(kv_prefix)
        rules += [f'# the jobs\' health checks: the external node "{name}" and its service',
                  f'node "{name}" {{\n  policy = "write"\n}}',
                  f'service "{name}" {{\n  policy = "write"\n}}']
    return "\n".join(rules) + "\n"
