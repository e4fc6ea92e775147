"""Prefill/decode disaggregation's transfer peer: the Mooncake transfer engine over the
KV pool, the bootstrap server a prefill engine's ranks register at, and the control
connections between prefill and decode ranks (docs/design/disaggregation.md).

Everything here runs on the peer's own threads (the ``ts-pd`` event loop, the write
workers), never in the round; the control plane reaches it only through
``control.pd.TransferPeer``, the data plane hands it each plan's remote streams.
"""
