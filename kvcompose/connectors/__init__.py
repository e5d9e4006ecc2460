"""vLLM connectors: the composite and the children kvcompose ships.

Importing this package imports vLLM.
"""

from kvcompose.connectors.composite import KVComposeConnector, KVComposeHMAConnector
from kvcompose.connectors.fault_injection import FaultInjectionConnector

__all__ = ["FaultInjectionConnector", "KVComposeConnector", "KVComposeHMAConnector"]
