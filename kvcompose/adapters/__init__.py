"""Connector adapters: what kvcompose reads of a specific child connector's internals, one module per connector.

vLLM's connector API tells when a child's transfers complete only in general
terms; the copy times, and an OffloadingConnector's transfers themselves, are
in classes of the connector's own, experimental and free to change between
releases. Each adapter names every vLLM class and field it reads (its
``CONTRACT``, see :mod:`kvcompose.adapters.contract`) and reads them plainly;
``tests/test_adapters.py`` checks each contract against every vLLM release
kvcompose supports, so a renamed field fails a test by name. On a vLLM that
breaks a contract, the adapter warns once and reads nothing, rather than fail
the engine's step or drop copy times silently.

The package imports no other kvcompose subpackage (only neutral modules):
instrumentation and metrics import it.
"""
