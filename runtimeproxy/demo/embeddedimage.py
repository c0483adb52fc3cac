"""Offline OCI images for the private containerd (``runtimeproxy.demo.embedded``): built
from the host's static busybox, because no registry is reachable. ``build_*_image``
writes an OCI layout tar that ``EmbeddedContainerd.import_image`` loads.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path

BUSYBOX_IMAGE = "docker.io/koord/busybox:test"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PAUSE_IMAGE = "docker.io/koord/pause:test"
_BUSYBOX_BIN = Path("/bin/busybox")
_LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
_CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
_MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
_PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
_GROUP = b"root:x:0:\nnogroup:x:65534:\n"


# --------------------------------------------------------------------------
# Offline OCI images
# --------------------------------------------------------------------------


def _oci_arch() -> str:
    """Map the kernel machine name to the OCI architecture ctr will unpack."""
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(machine, machine)


def _busybox_applets() -> list[str]:
    """Ask busybox which applets it has, so every one becomes a /bin symlink."""
    out = subprocess.run(
        [str(_BUSYBOX_BIN), "--list"], check=True, capture_output=True, text=True
    ).stdout
    return sorted({name for name in out.split() if name and "/" not in name and name != "busybox"})


def _tar_entry(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    """A tar header with fixed owner and mtime so the layer digest is stable."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.linkname = link
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    """Add a regular file from memory."""
    tar.addfile(_tar_entry(name, tarfile.REGTYPE, mode, len(data)), io.BytesIO(data))


def _busybox_layer() -> bytes:
    """Build the single rootfs layer: busybox, its applet links, a minimal /etc."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d, mode in (("bin", 0o755), ("dev", 0o755), ("etc", 0o755), ("proc", 0o555),
                        ("root", 0o700), ("sys", 0o555), ("tmp", 0o1777), ("var", 0o755)):
            tar.addfile(_tar_entry(d, tarfile.DIRTYPE, mode))
        _add_file(tar, "bin/busybox", _BUSYBOX_BIN.read_bytes(), 0o755)
        for applet in _busybox_applets():
            tar.addfile(_tar_entry(f"bin/{applet}", tarfile.SYMTYPE, 0o777, link="busybox"))
        _add_file(tar, "etc/passwd", _PASSWD, 0o644)
        _add_file(tar, "etc/group", _GROUP, 0o644)
    return buf.getvalue()


def _canonical_json(obj: object) -> bytes:
    """Serialise deterministically, since the bytes define the blob digest."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media_type: str, blob: bytes) -> dict[str, object]:
    """An OCI content descriptor for an in-memory blob."""
    return {"mediaType": media_type, "digest": _digest(blob), "size": len(blob)}


def _digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def _image_blobs(
    layer: bytes, entrypoint: Sequence[str], cmd: Sequence[str]
) -> tuple[bytes, bytes]:
    """Return (config, manifest) blobs for a one-layer image."""
    config = _canonical_json({
        "architecture": _oci_arch(),
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": [f"PATH={DEFAULT_PATH}"], "Entrypoint": list(entrypoint),
                   "Cmd": list(cmd), "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
    })
    manifest = _canonical_json({
        "schemaVersion": 2,
        "mediaType": _MANIFEST_MEDIA_TYPE,
        "config": _descriptor(_CONFIG_MEDIA_TYPE, config),
        "layers": [_descriptor(_LAYER_MEDIA_TYPE, layer)],
    })
    return config, manifest


def _index(manifest: bytes, ref: str) -> bytes:
    """index.json naming the image; ctr import reads io.containerd.image.name."""
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    entry = _descriptor(_MANIFEST_MEDIA_TYPE, manifest)
    entry["annotations"] = {"io.containerd.image.name": ref,
                            "org.opencontainers.image.ref.name": tag}
    return _canonical_json({"schemaVersion": 2, "manifests": [entry]})


def _write_layout_tar(path: Path, blobs: Sequence[bytes], index: bytes) -> None:
    """Write an OCI image-layout archive (oci-layout, index.json, blobs/)."""
    with tarfile.open(path, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_tar_entry("blobs", tarfile.DIRTYPE, 0o755))
        tar.addfile(_tar_entry("blobs/sha256", tarfile.DIRTYPE, 0o755))
        for blob in blobs:
            _add_file(tar, "blobs/sha256/" + _digest(blob).split(":", 1)[1], blob, 0o644)
        _add_file(tar, "oci-layout", _canonical_json({"imageLayoutVersion": "1.0.0"}), 0o644)
        _add_file(tar, "index.json", index, 0o644)


def _build_image(
    dest_dir: Path, ref: str, entrypoint: Sequence[str], cmd: Sequence[str]
) -> Path:
    """Shared builder for the busybox and pause images."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    layer = _busybox_layer()
    config, manifest = _image_blobs(layer, entrypoint, cmd)
    name = ref.rsplit("/", 1)[-1].replace(":", "_")
    out = dest_dir / f"{name}.oci.tar"
    _write_layout_tar(out, [layer, config, manifest], _index(manifest, ref))
    return out


def build_busybox_image(dest_dir: Path, ref: str = BUSYBOX_IMAGE) -> Path:
    """Build a busybox OCI archive (default command ``sh``) without any network.

    Every busybox applet is a symlink in /bin, so ``sleep``, ``cat``, ``dd``,
    ``yes`` ... work as commands.  The archive is byte-for-byte reproducible
    for a given /bin/busybox.
    """
    return _build_image(dest_dir, ref, entrypoint=[], cmd=["sh"])


def build_pause_image(dest_dir: Path, ref: str = PAUSE_IMAGE) -> Path:
    """Build the sandbox ("pause") image: busybox sleeping for ~68 years."""
    return _build_image(dest_dir, ref, entrypoint=["/bin/sleep", "2147483647"], cmd=[])
