"""vLLM's OffloadingConnector on CPU engines: an offloading spec whose worker copies on a thread.

Use it as a pipeline child (see ``examples/offload/pipeline.yaml``)::

    - name: offload
      connector: OffloadingConnector
      config:
        spec_name: CPUEngineOffloadingSpec
        spec_module_path: kvcompose.offload.spec
        cpu_bytes_to_use: 268435456

Importing this package does not import vLLM; ``kvcompose.offload.spec`` does.
"""

SPEC_NAME = "CPUEngineOffloadingSpec"
SPEC_MODULE = "kvcompose.offload.spec"
