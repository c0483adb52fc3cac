"""``tasks.metrics.kubelet``: the kubelet ``/pods`` enrichment the informer runs."""

from __future__ import annotations

from dataclasses import dataclass

from runtimeproxy.config.configvalues import Section, boolean, parse_duration, string


@dataclass(frozen=True, slots=True)
class KubeletSettings:
    """kubelet ``/pods`` enrichment (priority values); empty url = off."""

    url: str = ""
    token_path: str = ""
    ca_path: str = ""
    insecure: bool = False
    sync_interval: float = 10.0


def parse_kubelet(raw: object, key_path: str) -> KubeletSettings:
    args = Section.of(raw, key_path)
    base = KubeletSettings()
    args.reject_unknown(frozenset(KubeletSettings.__slots__))
    url = args.get("url", base.url, string)
    if url and not url.startswith(("http://", "https://")):
        raise args.fail("url", url, "must start with http:// or https://")
    return KubeletSettings(
        url=url.rstrip("/"),
        token_path=args.get("token_path", base.token_path, string),
        ca_path=args.get("ca_path", base.ca_path, string),
        insecure=args.get("insecure", base.insecure, boolean),
        sync_interval=args.get("sync_interval", base.sync_interval, parse_duration),
    )
