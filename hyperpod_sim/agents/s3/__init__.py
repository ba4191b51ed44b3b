"""The agent's S3 tier: persisting complete steps, reading what is on S3, and the blocking S3 calls."""
