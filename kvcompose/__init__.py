"""kvcompose: observability-first composition of vLLM KV-cache connectors.

Importing this package never imports vLLM; the connector classes live in
:mod:`kvcompose.connectors` and import vLLM when they are imported.
"""

from kvcompose.config import Pipeline, load_pipeline
from kvcompose.errors import PipelineConfigError, Problem

__all__ = ["Pipeline", "PipelineConfigError", "Problem", "load_pipeline"]
__version__ = "0.1.0"
