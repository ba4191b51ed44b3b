"""The command line: `hyperpod-sim` and its commands (clients of the API, and the shell that starts serve)."""
