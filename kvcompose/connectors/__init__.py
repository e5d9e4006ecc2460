"""vLLM connectors: the composite and the children kvcompose ships.

The names below load on first use (vLLM's connector factory reads them as
attributes of this module): importing a module of this package for what it
defines alone, such as the circuit breaker, does not import the composite.
"""

from __future__ import annotations

from kvcompose.lazy import lazy_attributes

_EXPORTS = {
    "KVComposeConnector": "kvcompose.connectors.composite",
    "KVComposeHMAConnector": "kvcompose.connectors.composite",
    "FaultInjectionConnector": "kvcompose.connectors.fault_injection",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
