"""The serve process: its process lock and data directory, and the embedded S3 (SeaweedFS) beside it."""
