"""Resources kept beside clusters in the account: cluster extensions and scheduler configs."""
