"""The agent launcher: the fork server that starts the local provisioner's agents (``server``) and
how a forked agent shows its own command line and environment in /proc (``title``)."""
