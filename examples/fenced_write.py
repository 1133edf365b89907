#!/usr/bin/env python3
"""A job that rejects a stale holder's write with CONSULRUN_FENCING_TOKEN.

No lock can stop a holder that was frozen (a VM pause, a stopped process)
for longer than lock-delay from running on for the tail of its pause, after
another node has taken the lock. The fencing token can: it is the lock key's
ModifyIndex when this run acquired it, so a later holder's token is larger.
Store the token beside the data and refuse to write over a larger one, with a
check-and-set so the check and the write are one step.

    consulrun run report -- examples/fenced_write.py reports/latest "report body"

Writes {"token": N, "data": ...} to Consul KV key KEY (the same agent
consulrun uses: CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN). Exit 0 when written,
3 when refused because a newer holder has written already.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import urllib.error
import urllib.request

STALE = 3


def _call(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    if os.environ.get("CONSUL_HTTP_TOKEN"):
        request.add_header("X-Consul-Token", os.environ["CONSUL_HTTP_TOKEN"])
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def fenced_write(key: str, data: str) -> bool:
    """Write `data` under `key` unless a holder with a larger token wrote there; False if refused."""
    token = int(os.environ["CONSULRUN_FENCING_TOKEN"])
    address = os.environ.get("CONSUL_HTTP_ADDR", "127.0.0.1:8500")
    base = (address if "://" in address else f"http://{address}") + f"/v1/kv/{key}"
    while True:
        status, body = _call("GET", base)
        index, stored = 0, {}
        if status == 200:
            entry = json.loads(body)[0]
            index = entry["ModifyIndex"]
            stored = json.loads(base64.b64decode(entry["Value"] or b"") or b"{}")
        elif status != 404:
            raise SystemExit(f"fenced_write: reading {key}: HTTP {status}")
        if stored.get("token", 0) > token:
            return False
        value = json.dumps({"token": token, "data": data}).encode()
        status, body = _call("PUT", f"{base}?cas={index}", value)
        if status == 200 and body.strip() == b"true":
            return True
        # Someone wrote between our read and our write: read again and decide again.


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: fenced_write.py KEY DATA", file=sys.stderr)
        return 2
    if fenced_write(sys.argv[1], sys.argv[2]):
        return 0
    print(f"fenced_write: refused: a newer holder (token > {os.environ['CONSULRUN_FENCING_TOKEN']}) has written "
          f"{sys.argv[1]}", file=sys.stderr)
    return STALE


if __name__ == "__main__":
    sys.exit(main())
