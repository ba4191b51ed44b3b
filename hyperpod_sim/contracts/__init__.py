"""What the control plane, the node agents, the SDK and the CLI agree on, declared once.

Every side imports this package; it imports nothing of ours and only light libraries (pydantic,
xxhash, botocore's model classes for the extensions model, the standard library), so a trainer's
SDK can use it without the server.
"""
