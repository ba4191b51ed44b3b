"""What the control plane, the agents, the SDK and the CLI agree on, declared once."""
