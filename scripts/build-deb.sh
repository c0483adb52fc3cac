#!/usr/bin/env bash
# Build the Debian package of koord-runtime-proxy: scripts/build-deb.sh [VERSION] [OUTDIR]
# (as root; VERSION defaults to setup.cfg's, OUTDIR to dist/).
#
# dpkg-deb over a prepared tree (packaging/deb/), not debhelper + dh-virtualenv: the package is
# one venv plus a few files, and a venv is not relocatable, so it is built at its final path
# (/opt/koord-runtime-proxy/venv) inside a Debian 12 root (the cached root of
# scripts/setup-host.sh, as an overlay: the cache is not written) with the same python3.11 the
# node runs, from wheels built here: no debian/ toolchain, no network inside.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-$(sed -n 's/^version *= *//p' setup.cfg)}
outdir=$(realpath -m "${2:-dist}")
root=/var/cache/koord-runtime-proxy/systemd-root
[[ -x $root/usr/bin/python3 ]] || { echo "build-deb: no Debian root at $root: run scripts/setup-host.sh" >&2; exit 1; }
python=python3
[[ -x .venv/bin/python ]] && python=.venv/bin/python

work=$(mktemp -d /tmp/krp-deb-XXXXXX)
made_build=0
[[ -e build ]] || made_build=1
cleanup() {
  mountpoint -q "$work/root" && umount "$work/root"
  rm -rf "$work"
  if ((made_build)); then rm -rf build; fi
}
trap cleanup EXIT
mkdir -p "$work"/{upper,ovl,root,pkg} "$outdir"
mount -t overlay overlay -o "lowerdir=$root,upperdir=$work/upper,workdir=$work/ovl" "$work/root"

wheels=$work/root/opt/krp-wheels
mkdir -p "$wheels"
"$python" -m pip wheel -q --no-deps -w "$wheels" . 2> >(grep -v "is ignored: it is" >&2)
"$python" -m pip wheel -q -w "$wheels" -r requirements.txt 2> >(grep -v "is ignored: it is" >&2)
cp requirements.txt "$wheels/"
# --system-site-packages: Debian's python3-bpfcc (Recommends) is importable from the venv.
chroot "$work/root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root /bin/sh -ec '
  rm -rf /opt/koord-runtime-proxy/venv
  python3 -m venv --system-site-packages /opt/koord-runtime-proxy/venv
  /opt/koord-runtime-proxy/venv/bin/pip install -q --no-index --no-cache-dir --find-links /opt/krp-wheels \
    -r /opt/krp-wheels/requirements.txt koord-runtime-proxy'

pkg=$work/pkg
install -d "$pkg/opt/koord-runtime-proxy" "$pkg/lib/systemd/system" "$pkg/etc/koord-runtime-proxy" \
  "$pkg/usr/share/doc/koord-runtime-proxy" "$pkg/usr/share/koord-runtime-proxy" "$pkg/usr/sbin" "$pkg/DEBIAN"
cp -a "$work/root/opt/koord-runtime-proxy/venv" "$pkg/opt/koord-runtime-proxy/venv"
ln -s /opt/koord-runtime-proxy/venv/bin/koord-runtime-proxy "$pkg/usr/sbin/koord-runtime-proxy"
install -m 0644 systemd/koord-runtime-proxy.service systemd/koord-runtime-proxy-haproxy.service "$pkg/lib/systemd/system/"
install -m 0644 systemd/config.yaml "$pkg/etc/koord-runtime-proxy/config.yaml"
# Pointing kubelet at the proxy is the operator's step (README), not an install side effect.
install -m 0644 systemd/10-koord-runtime-proxy.conf "$pkg/usr/share/koord-runtime-proxy/kubelet-10-koord-runtime-proxy.conf"
install -m 0644 README.md "$pkg/usr/share/doc/koord-runtime-proxy/README.md"
install -m 0644 packaging/deb/conffiles "$pkg/DEBIAN/conffiles"
install -m 0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$pkg/DEBIAN/"
size=$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@SIZE@/$size/" packaging/deb/control >"$pkg/DEBIAN/control"
deb="$outdir/koord-runtime-proxy_${version}_amd64.deb"
dpkg-deb --root-owner-group -Zgzip --build "$pkg" "$deb" >/dev/null
echo "$deb"
