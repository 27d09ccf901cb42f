"""The contract between callers and backends: the ``InterpModel`` protocol and its value types,
the base class every backend model extends, and the request checks it runs before any compute.

Backends import these names from :mod:`interp_engine.backend`, never from here."""
