#!/usr/bin/env bash
# Installs the cluster software the tests under tests/cluster start for real:
# Slurm (slurmctld, slurmd, the client commands), munge, OpenMPI's mpirun,
# and Podman with runc, netavark and aardvark-dns (real containers on a bridge
# network with name resolution) and mmdebstrap (their base image, made from
# Debian's packages).
# Debian packages only; idempotent (installs only what is missing) and
# non-interactive. Needs root. The tests configure and start the daemons
# themselves, in temporary folders: nothing here touches /etc/slurm or
# starts a service; the container tests keep their storage and network
# definitions in a temporary folder of their own, not in /etc/containers.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge openmpi-bin iproute2
          podman runc netavark aardvark-dns iptables mmdebstrap)

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "cluster-setup: ${PACKAGES[*]} already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "cluster-setup: missing ${missing[*]}; run this script as root to install them" >&2
    exit 1
fi

# Keep the packages' maintainer scripts from starting the system daemons
# (there is no system slurm.conf; the tests start their own).
created_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
echo "cluster-setup: installing ${missing[*]}"
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
