"""The domain layer: cluster lifecycle, node set, desired state. No HTTP in here."""
