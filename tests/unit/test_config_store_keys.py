"""The store's config keys: resync_interval and state_dir are validated, naming the key."""

from __future__ import annotations

import pytest

from runtimeproxy.config import settings as config
from runtimeproxy.config.settings import ConfigError


def test_defaults_and_values() -> None:
    default = config.from_mapping({})
    assert (default.resync_interval, default.state_dir) == (60.0, "/var/lib/koord-runtime-proxy")
    custom = config.from_mapping({"resync_interval": "2m", "state_dir": ""})
    assert (custom.resync_interval, custom.state_dir) == (120.0, "")


@pytest.mark.parametrize(("key", "value"), [
    ("resync_interval", "500ms"), ("resync_interval", 0), ("resync_interval", "soon"), ("resync_interval", True),
    ("state_dir", "var/lib/krp"), ("state_dir", 7), ("state_dir", "/var/\0lib"),
])
def test_bad_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({key: value})
    assert str(err.value).startswith(key), str(err.value)
