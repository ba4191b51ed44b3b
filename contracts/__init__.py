"""What the control plane, the node agents and the SDK agree on, declared once.

Every side imports this package; it imports nothing of ours and only light libraries (pydantic,
xxhash, the standard library), so a trainer's SDK can use it without the server.
"""
