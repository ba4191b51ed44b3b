"""Operations on a cluster's nodes: reboot, replace, add, move, deep health checks and rolling software
updates.
"""
