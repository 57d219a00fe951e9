"""Vocabulary shared by every layer (tenancy, gateway, worker) that none of them may own alone.

Tenancy stores a tenant's priority ceiling, the gateway caps a request's hint with it and the worker's
scheduler serves by it, so the one ``Priority`` lives below all three. Nothing here imports anything
of Loom's.
"""

from common.priority import Priority

__all__ = ["Priority"]
