"""Where the API server is and how to authenticate: in-cluster service account or a kubeconfig.

This replaces the ``kubernetes`` package's config loaders (importing that package costs
~17 MiB of generated models; docs/benchmarks.md, "Memory with a cluster connection").
What a node agent needs is covered: the in-cluster service account (token re-read from
disk, as projected tokens rotate), and kubeconfig users with a token, a token file,
client certificate/key (file or ``-data``), an ``exec`` credential plugin
(client.authentication.k8s.io ExecCredential, cached until its expiry) and
``insecure-skip-tls-verify``. ``auth-provider`` (the removed gcp/azure plugins) is refused
with a clear error.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from runtimeproxy.errors import KubeError

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeconfigError(KubeError, ValueError):
    """The cluster configuration (kubeconfig, service account) is missing or unusable
    (names the file and field)."""


@dataclass
class ClusterConfig:
    """One API server endpoint and its credentials."""

    host: str
    ssl_context: ssl.SSLContext | None = None
    token: str | None = None
    token_file: Path | None = None
    exec_spec: Mapping[str, Any] | None = None
    base_dir: Path = Path(".")
    _exec_token: tuple[str, float] | None = field(default=None, repr=False)
    _exec_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def authorization(self) -> str | None:
        """The ``Authorization`` header value, read fresh each call (token files rotate)."""
        if self.token_file is not None:
            try:
                return "Bearer " + self.token_file.read_text().strip()
            except OSError as exc:
                raise KubeconfigError(f"token file {self.token_file}: {exc}") from exc
        if self.exec_spec is not None:
            return "Bearer " + self._exec_credential()
        return None if self.token is None else "Bearer " + self.token

    def invalidate(self) -> None:
        """The server refused the credential (401): run the exec plugin again next time
        instead of sending a revoked token until its stated expiry."""
        with self._exec_lock:
            self._exec_token = None

    def _exec_credential(self) -> str:
        with self._exec_lock:
            if self._exec_token is not None and self._exec_token[1] > time.time() + 10:
                return self._exec_token[0]
            spec = self.exec_spec or {}
            command = spec.get("command")
            if not isinstance(command, str) or not command:
                raise KubeconfigError("user.exec.command is missing")
            args = [str(a) for a in spec.get("args") or []]
            env = dict(os.environ)
            # What client-go passes: plugins (kubelogin, cloud auth plugins) read the API version from it.
            env["KUBERNETES_EXEC_INFO"] = json.dumps({
                "apiVersion": str(spec.get("apiVersion") or "client.authentication.k8s.io/v1"),
                "kind": "ExecCredential", "spec": {"interactive": False}})
            for item in spec.get("env") or []:
                if isinstance(item, Mapping):
                    env[str(item.get("name"))] = str(item.get("value"))
            try:
                out = subprocess.run([command, *args], env=env, capture_output=True, timeout=30, check=True,
                                     cwd=self.base_dir).stdout
                status = json.loads(out)["status"]
                token = status["token"]
            except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as exc:
                raise KubeconfigError(f"user.exec {command!r}: no token: {exc}") from exc
            if not isinstance(token, str):
                raise KubeconfigError(f"user.exec {command!r}: status.token is not a string")
            expiry = time.time() + 300
            stamp = status.get("expirationTimestamp")
            if isinstance(stamp, str):
                try:
                    expiry = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
                except ValueError:
                    pass
            self._exec_token = (token, expiry)
            return token


def in_cluster(sa_dir: Path = SA_DIR, environ: Mapping[str, str] = os.environ) -> ClusterConfig:
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise KubeconfigError("not in a cluster: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set")
    token = sa_dir / "token"
    if not token.is_file():
        raise KubeconfigError(f"not in a cluster: {token} does not exist")
    try:
        ctx = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
    except (OSError, ssl.SSLError) as exc:
        raise KubeconfigError(f"in-cluster CA {sa_dir / 'ca.crt'}: {exc}") from exc
    if ":" in host:
        host = f"[{host}]"
    return ClusterConfig(host=f"https://{host}:{port}", ssl_context=ctx, token_file=token)


def _named(doc: Mapping[str, Any], section: str, name: object, where: str) -> Mapping[str, Any]:
    entries = doc.get(section) or []
    if not isinstance(entries, list):
        raise KubeconfigError(f"{where}: {section} is not a list")
    for entry in entries:
        if isinstance(entry, Mapping) and entry.get("name") == name:
            inner = entry.get(section[:-1])
            if not isinstance(inner, Mapping):
                raise KubeconfigError(f"{where}: {section}[name={name}].{section[:-1]} is not a mapping")
            return inner
    raise KubeconfigError(f"{where}: no {section[:-1]} named {name!r}")


def _material(entry: Mapping[str, Any], key: str, base: Path, where: str) -> bytes | None:
    """``key``'s content: ``key-data`` (base64) or the file ``key`` (relative to the kubeconfig)."""
    data = entry.get(f"{key}-data")
    if data is not None:
        try:
            return base64.b64decode(str(data), validate=True)
        except ValueError as exc:
            raise KubeconfigError(f"{where}: {key}-data is not base64: {exc}") from exc
    path = entry.get(key)
    if path is None:
        return None
    try:
        return (base / str(path)).read_bytes()
    except OSError as exc:
        raise KubeconfigError(f"{where}: {key} {path!r}: {exc}") from exc


def _ssl_context(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path, where: str) -> ssl.SSLContext:
    ca = _material(cluster, "certificate-authority", base, where)
    ctx = ssl.create_default_context(cadata=ca.decode() if ca is not None else None)
    if cluster.get("insecure-skip-tls-verify") is True:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    cert = _material(user, "client-certificate", base, where)
    key = _material(user, "client-key", base, where)
    if (cert is None) != (key is None):
        raise KubeconfigError(f"{where}: client-certificate and client-key must be given together")
    if cert is not None and key is not None:
        # ssl loads a chain only from files: a private temporary directory, removed at once.
        with tempfile.TemporaryDirectory(prefix="kubeconfig-") as tmp:
            cert_file, key_file = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            cert_file.write_bytes(cert)
            key_file.touch(mode=0o600)
            key_file.write_bytes(key)
            try:
                ctx.load_cert_chain(cert_file, key_file)
            except ssl.SSLError as exc:
                raise KubeconfigError(f"{where}: client certificate/key: {exc}") from exc
    return ctx


def from_kubeconfig(path: Path) -> ClusterConfig:
    """The current context of the kubeconfig at ``path``."""
    where = str(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise KubeconfigError(f"kubeconfig {where}: {exc}") from exc
    if not isinstance(doc, Mapping):
        raise KubeconfigError(f"kubeconfig {where}: not a mapping")
    context = _named(doc, "contexts", doc.get("current-context"), where)
    cluster = _named(doc, "clusters", context.get("cluster"), where)
    user: Mapping[str, Any] = _named(doc, "users", context.get("user"), where) if context.get("user") else {}
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("http://", "https://")):
        raise KubeconfigError(f"{where}: cluster.server {server!r} is not an http(s) URL")
    if "auth-provider" in user:
        raise KubeconfigError(f"{where}: user.auth-provider is not supported (use exec or a token)")
    base = path.parent
    token = user.get("token")
    token_file = user.get("tokenFile")
    exec_spec = user.get("exec")
    return ClusterConfig(
        host=server.rstrip("/"),
        ssl_context=_ssl_context(cluster, user, base, where) if server.startswith("https://") else None,
        token=str(token) if token is not None else None,
        token_file=base / str(token_file) if token_file is not None else None,
        exec_spec=exec_spec if isinstance(exec_spec, Mapping) else None,
        base_dir=base,
    )


def default_kubeconfig(environ: Mapping[str, str] = os.environ) -> Path:
    """$KUBECONFIG (its first entry), else ~/.kube/config."""
    env = environ.get("KUBECONFIG")
    if env:
        return Path(env.split(os.pathsep)[0]).expanduser()
    return Path("~/.kube/config").expanduser()
