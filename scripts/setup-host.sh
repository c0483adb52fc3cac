#!/usr/bin/env bash
# Prepare a Debian 12 host (as root): system packages, kernel headers for bcc,
# and the project venv in .venv. Idempotent; safe to run before every command.
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(containerd runc busybox-static containernetworking-plugins python3-venv python3-bpfcc linux-headers-amd64 haproxy)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup-host: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  # haproxy is our data plane's binary (data_plane: haproxy), run as koord-runtime-proxy's
  # child: the Debian service apt just enabled (and, under systemd, started) is not used.
  if [[ " ${missing[*]} " == *" haproxy "* && -d /run/systemd/system ]]; then
    systemctl disable --now haproxy.service >/dev/null 2>&1 || true
  fi
fi

# bcc compiles against /lib/modules/$(uname -r)/{build,source}. Kernels without
# their own headers get Debian's generic ones; eBPF programs use only tracepoint
# args and helpers, so a header version mismatch is harmless.
mods="/lib/modules/$(uname -r)"
if [[ ! -e "$mods/build" ]]; then
  hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1 || true)
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1 || true)
  if [[ -n "$hdr" && -n "$common" ]]; then
    mkdir -p "$mods"
    ln -sfn "$hdr" "$mods/build"
    ln -sfn "$common" "$mods/source"
  fi
fi

# bcc attaches tracepoints through tracefs; systemd hosts mount it, minimal VMs may not.
if [[ ! -d /sys/kernel/tracing/events/sched ]]; then
  mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || echo "setup-host: tracefs not mountable; eBPF collector will fall back to schedstat"
fi

# Debian's python (where python3-bpfcc lives), with system site packages for bcc.
if [[ ! -x .venv/bin/python ]]; then
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
stamp=.venv/.krp-installed
if [[ ! -f $stamp || requirements-dev.txt -nt $stamp || requirements.txt -nt $stamp || setup.cfg -nt $stamp ]]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  .venv/bin/python -m pip install -q --no-deps -e .
  touch "$stamp"
fi

# containerd 1.7.24 (NRI v0.6.1) for the NRI ingress's tests and `demo --ingress nri`:
# Debian 13's package, fetched with a private apt configuration (trixie suite, the host's
# own mirror and keyring) and unpacked with dpkg-deb into a private directory. Nothing is
# installed system-wide; the Debian 12 containerd 1.6 stays the one on PATH.
ctrd17=/var/cache/koord-runtime-proxy/containerd-1.7
if [[ ! -x $ctrd17/usr/bin/containerd ]]; then
  apt17=/var/cache/koord-runtime-proxy/apt-trixie
  mkdir -p "$apt17/lists/partial" "$apt17/cache/archives/partial" "$apt17/debs"
  mirror=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -m1 '/debian$' || true)
  [[ -n $mirror ]] || mirror=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -m1 '/debian/*$' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" >"$apt17/trixie.sources"
  aptopts=(-o "Dir::Etc::sourcelist=$apt17/trixie.sources" -o Dir::Etc::sourceparts=/nonexistent
           -o "Dir::State::Lists=$apt17/lists" -o "Dir::Cache=$apt17/cache" -o APT::Architecture=amd64)
  apt-get -qq "${aptopts[@]}" update
  (cd "$apt17/debs" && apt-get -qq "${aptopts[@]}" download containerd)
  deb=$(ls "$apt17"/debs/containerd_1.7.*_amd64.deb | sort -V | tail -1)
  rm -rf "$ctrd17.tmp" && mkdir -p "$ctrd17.tmp"
  dpkg-deb -x "$deb" "$ctrd17.tmp"
  "$ctrd17.tmp/usr/bin/containerd" --version
  rm -rf "$ctrd17" && mv "$ctrd17.tmp" "$ctrd17"
fi

# A bootable Debian root for the real-systemd test (tests/integration/test_systemd_units.py):
# the shipped units run in it under systemd-nspawn. Built once into the cache, rebuilt only when
# missing or when this recipe changes (its text is the stamp); the tests boot an overlay of it.
# procps: /bin/kill, which the units (and Debian's own haproxy.service) reload with.
SYSTEMD_ROOT_PKGS="systemd,systemd-sysv,dbus,haproxy,procps,python3,python3-venv,util-linux"
sysroot=/var/cache/koord-runtime-proxy/systemd-root
for p in debootstrap systemd-container; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap systemd-container >/dev/null
    break
  }
done
mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p; s/^deb  *\(\[[^]]*\] *\)\{0,1\}\(http[^ ]*debian\)  *bookworm .*/\2/p' \
  /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null | head -1 || true)
mirror=${mirror:-http://deb.debian.org/debian}
# rev: bump when the steps after debootstrap below change (the recipe text is the cache's stamp).
recipe="rev 1: debootstrap --variant=minbase --include=$SYSTEMD_ROOT_PKGS bookworm ROOT $mirror"
mkdir -p "$(dirname "$sysroot")"
(
  flock 9  # helpers and CI jobs on one host build it once
  if [[ ! -f $sysroot.recipe || "$(cat "$sysroot.recipe")" != "$recipe" || ! -x $sysroot/lib/systemd/systemd ]]; then
    echo "setup-host: building $sysroot ($recipe)"
    rm -rf "$sysroot.new" "$sysroot.recipe"
    debootstrap --variant=minbase --include="$SYSTEMD_ROOT_PKGS" bookworm "$sysroot.new" "$mirror" \
      >"$(dirname "$sysroot")/debootstrap.log" 2>&1 \
      || { echo "setup-host: debootstrap failed, see $(dirname "$sysroot")/debootstrap.log"; exit 1; }
    # The tests upgrade HAProxy with dpkg from this .deb (debootstrap keeps what it installed).
    ls "$sysroot.new"/var/cache/apt/archives/haproxy_*.deb >/dev/null \
      || { echo "setup-host: no haproxy .deb left in the root's apt cache"; exit 1; }
    # Debian's own haproxy.service (its sample config) is not ours: never started in the root.
    rm -f "$sysroot.new"/etc/systemd/system/multi-user.target.wants/haproxy.service
    # A venv the tests install the project's wheel into (no network inside the root).
    chroot "$sysroot.new" /usr/bin/python3 -m venv /opt/koord-runtime-proxy/venv
    rm -rf "$sysroot" && mv "$sysroot.new" "$sysroot"
    echo "$recipe" >"$sysroot.recipe"
  fi
) 9>"$(dirname "$sysroot")/.systemd-root.lock"
