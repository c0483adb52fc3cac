"""The API client's timeout, TLS and credentials in real handshakes with the local test API server
(``tests.kubeapi`` serving HTTPS): a server certificate from another CA is refused,
``insecure-skip-tls-verify`` connects anyway, and the in-cluster service account works
against an IP address (as ``KUBERNETES_SERVICE_HOST`` is) with its token re-read as the
kubelet rotates it."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from metrics.informer import kubeclient
from metrics.informer.kubeclient import KubeClient, KubeSettings
from metrics.informer.kubeconfig import in_cluster
from metrics.informer.kubetypes import KubeApiError, KubeUnavailable
from tests.kubeapi import KubeApiServer
from tests.unit.metrics.test_kubeconfig import openssl, write

NODE = "node-a"


def _ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
            "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca (signs the server's certificate for IP 127.0.0.1) and other-ca (signs nothing)."""
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "other-ca")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver", "-keyout", str(d / "server.key"),
            "-out", str(d / "server.csr"))
    openssl("x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
            "-CAcreateserial", "-days", "1", "-out", str(d / "server.crt"), "-extfile", str(d / "san.ext"))
    return d


@pytest.fixture
def api(certs: Path) -> Iterator[KubeApiServer]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs / "server.crt", certs / "server.key")
    server = KubeApiServer(tls=ctx)
    server.put("nodes", {"metadata": {"name": NODE}})
    yield server
    server.close()


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_a_server_certificate_from_another_ca_is_refused(tmp_path: Path, certs: Path, api: KubeApiServer) -> None:
    other_ca = _b64(certs / "other-ca.crt")
    path = write(tmp_path, {"token": "t"}, {"server": api.url, "certificate-authority-data": other_ca})
    client = KubeClient.connect(KubeSettings(NODE, kubeconfig=path, timeout=5))
    try:
        with pytest.raises(KubeUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            client.get_node()
    finally:
        client.close()
    assert not api.requests  # no request was sent over the unverified connection


def test_insecure_skip_tls_verify_connects_to_an_unknown_ca(tmp_path: Path, api: KubeApiServer) -> None:
    """Said once in the JSON log; urllib3's InsecureRequestWarning (a non-JSON stderr line,
    an error under -W error) is not raised per request."""
    path = write(tmp_path, {"token": "t"}, {"server": api.url, "insecure-skip-tls-verify": True})
    with capture_logs() as logs, warnings.catch_warnings():
        warnings.simplefilter("error")
        client = KubeClient.connect(KubeSettings(NODE, kubeconfig=path, timeout=5))
        try:
            assert client.get_node()["metadata"]["name"] == NODE
            assert client.get_node()["metadata"]["name"] == NODE
        finally:
            client.close()
    assert [e["host"] for e in logs if e["event"] == "kube_tls_unverified"] == [api.url]


def test_in_cluster_over_tls_to_an_ip_with_a_rotating_token(
    tmp_path: Path, certs: Path, api: KubeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "ca.crt").write_bytes((certs / "ca.crt").read_bytes())
    (sa / "token").write_text("token-1\n")
    port = api.url.rsplit(":", 1)[1]
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
    monkeypatch.setattr(kubeclient, "in_cluster", lambda: in_cluster(sa, env))
    client = KubeClient.connect(KubeSettings(NODE, in_cluster=True, timeout=5))
    try:
        assert client.config.host == f"https://127.0.0.1:{port}"
        client.get_node()
        (sa / "token").write_text("token-2\n")  # the kubelet rotated the projected token
        client.get_node()
    finally:
        client.close()
    assert [r.headers.get("authorization") for r in api.requests] == ["Bearer token-1", "Bearer token-2"]


def test_a_server_that_never_answers_times_out(tmp_path: Path) -> None:
    """A listening socket that accepts nothing (a hung API server): the call fails with
    KubeUnavailable after the configured timeout instead of blocking its thread for good."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        client = KubeClient.connect(KubeSettings(NODE, kubeconfig=write(tmp_path, {"token": "t"}, {"server": url}),
                                                 timeout=0.5))
        started = time.monotonic()
        try:
            with pytest.raises(KubeUnavailable, match="get node"):
                client.get_node()
        finally:
            client.close()
        assert time.monotonic() - started < 3


def test_a_refused_exec_token_is_fetched_again(tmp_path: Path) -> None:
    """An exec plugin's token revoked before its stated expiry: the 401 drops the cached
    token, the next call runs the plugin again. The plugin gets KUBERNETES_EXEC_INFO with
    its API version, as client-go passes it."""
    counter, seen_info = tmp_path / "calls", tmp_path / "exec-info"
    plugin = tmp_path / "plugin.sh"
    plugin.write_text(f"#!/bin/sh\necho x >> {counter}\nprintf '%s' \"$KUBERNETES_EXEC_INFO\" > {seen_info}\n"
                      f"n=$(wc -l < {counter} | tr -d ' ')\n"
                      'echo "{\\"kind\\":\\"ExecCredential\\",\\"status\\":{\\"token\\":\\"tok-$n\\",'
                      '\\"expirationTimestamp\\":\\"2999-01-01T00:00:00Z\\"}}"\n')
    plugin.chmod(0o700)
    api = KubeApiServer()
    api.put("nodes", {"metadata": {"name": NODE}})
    real = api._serve

    def auth(req: Any) -> Any:
        if req.headers.get("authorization") != "Bearer tok-2":
            return 401, {"kind": "Status", "code": 401, "message": "Unauthorized"}
        return real(req)

    api.routes[("GET", f"/api/v1/nodes/{NODE}")] = auth
    version = "client.authentication.k8s.io/v1beta1"
    path = write(tmp_path, {"exec": {"apiVersion": version, "command": str(plugin)}}, {"server": api.url})
    client = KubeClient.connect(KubeSettings(NODE, kubeconfig=path, timeout=5))
    try:
        with pytest.raises(KubeApiError, match="401"):
            client.get_node()
        assert client.get_node()["metadata"]["name"] == NODE
        assert client.get_node()["metadata"]["name"] == NODE  # the new token is cached again
    finally:
        client.close()
        api.close()
    assert counter.read_text() == "x\nx\n"
    assert json.loads(seen_info.read_text()) == {"apiVersion": version, "kind": "ExecCredential",
                                                 "spec": {"interactive": False}}
