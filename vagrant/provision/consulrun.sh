#!/usr/bin/env bash
# Installs consulrun from the synced checkout with pip, adds stand-ins for the
# example manifest's programs, and installs the example manifest's units.
set -euo pipefail

python3 -m venv /opt/consulrun
/opt/consulrun/bin/pip install -q /vagrant
ln -sf /opt/consulrun/bin/consulrun /usr/local/bin/consulrun

# The example jobs' programs, user and folders, as stand-ins that log where they ran.
id billing >/dev/null 2>&1 || useradd --system --home /srv/billing billing
install -d -o billing /srv/billing /srv/reports
touch /etc/billing.env
for prog in billing-report warm-cache; do
  printf '#!/bin/sh\necho "%s ran on $(hostname) for occurrence ${CONSULRUN_OCCURRENCE:-none}: $*"\nsleep 20\n' "$prog" \
    > "/usr/local/bin/$prog"
  chmod 755 "/usr/local/bin/$prog"
done
# The manifest names a token file; this demo cluster has no ACLs, so it is empty (and root-only).
install -d -m 0755 /etc/consulrun
install -m 0600 /dev/null /etc/consulrun/token

for _ in $(seq 60); do consul members >/dev/null 2>&1 && break; sleep 2; done
consulrun install /vagrant/examples/jobs.yaml --consulrun-path /usr/local/bin/consulrun
