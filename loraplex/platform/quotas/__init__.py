"""Per-tenant quotas: one atomic admission check, Redis-backed or in-process (see limits.py)."""
