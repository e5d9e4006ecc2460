"""vLLM connectors: the composite and the children kvcompose ships.

Importing this package imports vLLM.
"""

from kvcompose.connectors.composite import KVComposeConnector, KVComposeHMAConnector

__all__ = ["KVComposeConnector", "KVComposeHMAConnector"]
