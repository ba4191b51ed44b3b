"""The agent's own small HTTP/1.1 server (docs/decisions/: why not a framework): server, connections,
messages.
"""
