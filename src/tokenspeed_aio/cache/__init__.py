"""The host KV tiers' data-plane half: the L2 host pool and the retraction snapshot pool
(pinned host buffers), the copies between them and the device KV pool on their own
streams, and the completions the control plane polls."""
