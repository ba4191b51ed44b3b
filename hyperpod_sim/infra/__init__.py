"""Infrastructure at the edge: what the domain decides, done on this machine (agent processes,
their pidfiles, /proc, shared memory). The domain sees it only through its interfaces
(``domain.provisioning.Provisioner``); the app factory picks the implementation."""
