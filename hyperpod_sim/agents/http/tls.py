"""The one TLS context of an agent's HTTP clients.

A client that builds a context of its own (httpx's default ``verify=True``, aiohttp's default
``ssl``) loads the CA bundle into it: about a MiB of memory per client. An agent's clients verify
with this one instead; the agent launcher (agents/launcher.py) builds it before it forks, so that
every agent it starts shares its pages instead of loading the bundle again.
"""

from __future__ import annotations

import ssl
from functools import cache


@cache
def client_context() -> ssl.SSLContext:
    """A verifying context with certifi's CA bundle, built once per process."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())
