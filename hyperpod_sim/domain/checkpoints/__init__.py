"""Checkpoints: the per-cluster policy, the policy document each node's agent gets, its pushes, and where
the checkpoints are.
"""
