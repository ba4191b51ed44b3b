"""Handlers of operations on resources beside the cluster itself, and the output members derived from what
a cluster stores.
"""
