"""The agent's own small HTTP/1.1 server (docs/decisions/: why not a framework): server, connections,
messages; and the one TLS context of the agent's HTTP clients (``tls``).
"""
