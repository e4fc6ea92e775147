"""The client tests run against the same server fixture as tests/server (one
definition, in tests/server/conftest.py)."""

from server.conftest import http_server, server_checkpoint, start_engine  # noqa: F401
