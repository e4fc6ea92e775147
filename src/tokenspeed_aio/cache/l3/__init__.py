"""The L3 storage tier's host half: storage backends (a local directory, the Mooncake
distributed store), the deployment identity that names their objects, and the executor of
host worker threads that runs the scheduler's storage operations against the L2 pages."""
