"""Nodes and their agents: the node set the reconciler makes and fails, their health, recovery,
credentials, attachments and the agent protocol's control-plane side.
"""
