"""Loading where the API server is and how to authenticate (in-cluster, kubeconfig)."""

from __future__ import annotations

import base64
import json
import ssl
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from metrics.informer.kubeconfig import KubeconfigError, default_kubeconfig, from_kubeconfig, in_cluster


def write(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster or {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))
    return path


def test_token_and_token_file_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    assert from_kubeconfig(write(tmp_path, {"token": "abc"})).authorization() == "Bearer abc"
    (tmp_path / "tok").write_text("one\n")
    config = from_kubeconfig(write(tmp_path, {"tokenFile": "tok"}))
    assert config.authorization() == "Bearer one"
    (tmp_path / "tok").write_text("two\n")  # rotated on disk: read again
    assert config.authorization() == "Bearer two"
    assert config.host == "http://127.0.0.1:1" and config.ssl_context is None


def test_exec_plugin_token_is_cached_until_expiry(tmp_path: Path) -> None:
    counter = tmp_path / "calls"
    plugin = tmp_path / "plugin.sh"
    plugin.write_text("#!/bin/sh\necho x >> " + str(counter) + "\n"
                      'echo \'{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential",'
                      '"status":{"token":"exec-tok","expirationTimestamp":"2999-01-01T00:00:00Z"}}\'\n')
    plugin.chmod(plugin.stat().st_mode | stat.S_IEXEC)
    config = from_kubeconfig(write(tmp_path, {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                                       "command": str(plugin)}}))
    assert config.authorization() == "Bearer exec-tok"
    assert config.authorization() == "Bearer exec-tok"
    assert counter.read_text() == "x\n"
    broken = from_kubeconfig(write(tmp_path, {"exec": {"command": "/bin/false"}}))
    with pytest.raises(KubeconfigError, match=r"user\.exec '/bin/false'"):
        broken.authorization()


def test_https_cluster_gets_a_verifying_context_unless_told_not_to(tmp_path: Path) -> None:
    config = from_kubeconfig(write(tmp_path, {"token": "t"}, {"server": "https://api:6443"}))
    assert config.ssl_context is not None and config.ssl_context.verify_mode == ssl.CERT_REQUIRED
    config = from_kubeconfig(write(tmp_path, {"token": "t"},
                                   {"server": "https://api:6443", "insecure-skip-tls-verify": True}))
    assert config.ssl_context is not None and config.ssl_context.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(("user", "cluster", "message"), [
    ({"auth-provider": {"name": "gcp"}}, None, "auth-provider is not supported"),
    ({"client-certificate-data": base64.b64encode(b"x").decode()}, {"server": "https://a"},
     "client-certificate and client-key must be given together"),
    ({}, {"server": "https://a", "certificate-authority-data": "%%%"}, "certificate-authority-data is not base64"),
    ({}, {"server": "https://a", "certificate-authority": "absent.crt"}, "certificate-authority 'absent.crt'"),
    ({}, {"server": "ftp://a"}, "cluster.server 'ftp://a' is not an http"),
])
def test_bad_kubeconfig_names_the_field(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None,
                                        message: str) -> None:
    with pytest.raises(KubeconfigError, match=message):
        from_kubeconfig(write(tmp_path, user, cluster))


def test_missing_context_and_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "kc"
    path.write_text(json.dumps({"current-context": "nope", "contexts": []}))
    with pytest.raises(KubeconfigError, match="no context named 'nope'"):
        from_kubeconfig(path)
    path.write_text("- a list")
    with pytest.raises(KubeconfigError, match="not a mapping"):
        from_kubeconfig(path)


def test_in_cluster_reads_the_service_account(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster(tmp_path, {})
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubeconfigError, match="token does not exist"):
        in_cluster(tmp_path, env)
    (tmp_path / "token").write_text("sa-token")
    with pytest.raises(KubeconfigError, match=r"in-cluster CA .*ca\.crt"):
        in_cluster(tmp_path, env)
    ca = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
    (tmp_path / "ca.crt").write_bytes(ca.read_bytes())
    config = in_cluster(tmp_path, env)
    assert config.host == "https://[fd00::1]:443"
    assert config.authorization() == "Bearer sa-token"


def test_default_kubeconfig_follows_the_environment() -> None:
    assert default_kubeconfig({"KUBECONFIG": "/a/b:/c/d"}) == Path("/a/b")
    assert default_kubeconfig({}).name == "config"


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def test_tls_with_a_ca_and_a_client_certificate_from_kubeconfig_data(tmp_path: Path) -> None:
    """A real TLS handshake with the loader's context: server verified against the
    kubeconfig's CA (data), the client authenticated by its certificate/key (data)."""
    from metrics.informer.kubeclient import KubeApiError, KubeClient, KubeSettings
    from tests.kubeapi import KubeApiServer

    d = tmp_path
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", str(d / "san.ext")]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(d / f"{name}.key"),
                "-out", str(d / f"{name}.csr"))
        openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-days", "1", "-out", str(d / f"{name}.crt"), *ext)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(d / "server.crt", d / "server.key")
    server_ctx.load_verify_locations(d / "ca.crt")
    server_ctx.verify_mode = ssl.CERT_REQUIRED  # no client certificate: no handshake
    api = KubeApiServer(tls=server_ctx)
    try:
        api.put("nodes", {"metadata": {"name": "node-a"}})

        def data(name: str) -> str:
            return base64.b64encode((d / name).read_bytes()).decode()

        path = write(tmp_path, {"client-certificate-data": data("client.crt"), "client-key-data": data("client.key")},
                     {"server": api.url, "certificate-authority-data": data("ca.crt")})
        client = KubeClient.connect(KubeSettings("node-a", kubeconfig=path, timeout=5))
        assert client.get_node()["metadata"]["name"] == "node-a"
        client.close()
        # Without the client certificate the server refuses the handshake: KubeUnavailable, not a crash.
        from metrics.informer.kubetypes import KubeUnavailable

        anonymous = KubeClient.connect(KubeSettings("node-a", kubeconfig=write(
            tmp_path, {"token": "t"}, {"server": api.url, "certificate-authority-data": data("ca.crt")}), timeout=5))
        with pytest.raises((KubeUnavailable, KubeApiError)):
            anonymous.get_node()
        anonymous.close()
    finally:
        api.close()
