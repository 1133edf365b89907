#!/usr/bin/env bash
# Installs Consul from HashiCorp's Debian repository at a pinned version and
# makes this node one of three servers. Arguments: NAME IP VERSION PEERS(ip,ip,ip) ui|no-ui
set -euo pipefail
name=$1 ip=$2 version=$3 peers=$4 ui=$5

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq gpg curl lsb-release python3-venv >/dev/null
if [[ ! -f /usr/share/keyrings/hashicorp.gpg ]]; then
  curl -fsSL https://apt.releases.hashicorp.com/gpg | gpg --dearmor -o /usr/share/keyrings/hashicorp.gpg
  echo "deb [signed-by=/usr/share/keyrings/hashicorp.gpg] https://apt.releases.hashicorp.com $(lsb_release -cs) main" \
    > /etc/apt/sources.list.d/hashicorp.list
  apt-get update -qq
fi
apt-get install -y -qq "consul=${version}-1" >/dev/null
apt-mark hold consul >/dev/null

join=$(echo "$peers" | tr ',' '\n' | grep -v "^${ip}$" | sed 's/.*/"&"/' | paste -sd, -)
cat > /etc/consul.d/consul.hcl <<HCL
node_name        = "${name}"
datacenter       = "dc1"
data_dir         = "/opt/consul"
server           = true
bootstrap_expect = 3
bind_addr        = "${ip}"
client_addr      = "$([[ $ui == ui ]] && echo 0.0.0.0 || echo 127.0.0.1)"
retry_join       = [${join}]
ui_config { enabled = $([[ $ui == ui ]] && echo true || echo false) }
HCL
chown -R consul:consul /etc/consul.d /opt/consul
systemctl enable --now consul
