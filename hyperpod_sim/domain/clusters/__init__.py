"""Clusters: their lifecycle (CreateCluster, UpdateCluster, DeleteCluster, ...) and the rules botocore's
shapes cannot express.
"""
