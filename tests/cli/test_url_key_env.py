"""A base URL carrying a query (`?api_key=…`) is refused naming the URL's own key and the key whose variable
carries that URL's API key: server.urls → server.api_key_env, record.upstream → record.api_key_env; URLs whose
requests send no key (bench.urls) name none. The key itself is never shown."""

from __future__ import annotations

import pytest

from dflashkit.config import load_config
from dflashkit.errors import ConfigError

OTHER_ENV = {"server.urls": "record.api_key_env", "record.upstream": "server.api_key_env"}


@pytest.mark.parametrize("key,value,env", [
    ("server.urls", '["http://h:8000/v1?api_key=sk-secret1"]', "server.api_key_env"),
    ("record.upstream", "http://h:8000/v1?api_key=sk-secret1", "record.api_key_env"),
    ("bench.urls", '["http://h:8000/v1?api_key=sk-secret1"]', None),
])
def test_query_in_a_url_names_its_own_key_variable(key, value, env):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    msg = str(e.value)
    assert f"{key}" in msg and "cannot carry a query" in msg and "sk-secret1" not in msg
    if env is None:
        assert "api_key_env" not in msg and "send no API key" in msg
    else:
        assert f"variable {env} names" in msg and OTHER_ENV[key] not in msg
